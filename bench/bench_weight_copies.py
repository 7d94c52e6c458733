"""The weight path's copy rate beside a busy GPU: does the device cast hold the link up?

A streamed region's fp32 masters reach the GPU through one device staging chunk on the
copy stream (runtime/weight_fetch.py, `_copy_in_and_cast`): copy a chunk of pinned fp32 in,
cast it into the region's bf16 buffer, copy the next chunk. Everything on the copy stream
runs in order, so the link idles from the end of one chunk's copy until its cast kernel
has run, and a cast launched while the compute stream's matmuls fill every SM waits for
their blocks to drain. Training rows measured the weight copies at half the probe's rate.

This times that pattern on its own and beside a compute stream kept busy with the
model's matmul shape, for the candidate ways out, each in the same process:

- ``serial``: the runtime's pattern (one chunk, copy and cast on the copy stream);
- ``priority``: the same on a copy stream of the highest priority, so the cast's blocks
  are scheduled before the matmul's waiting ones;
- ``split``: the chunk halved, copies on the copy stream and casts on a second stream,
  alternating halves, so the link fills one half while the other waits for its cast;
- ``split+priority``: both.

Per variant: the copy's GB/s (fp32 bytes over the link) alone and beside the matmuls, and
the matmuls' TFLOP/s beside it against alone. CUDA only.

    python bench/bench_weight_copies.py --out bench/results/weight_copies.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

CHUNK = 16 << 20  # fp32 elements, runtime/streamer.py's CAST_CHUNK


def _streams(priority: bool):
    high = torch.cuda.Stream(priority=-1) if priority else torch.cuda.Stream()
    return high, (torch.cuda.Stream(priority=-1) if priority else torch.cuda.Stream())


def fetch(src: torch.Tensor, dst: torch.Tensor, chunk: torch.Tensor, copy_stream, cast_stream,
          split: bool) -> None:
    """Queue one region's copy in and cast (src pinned fp32 -> dst bf16)."""
    n = src.numel()
    if not split:
        with torch.cuda.stream(copy_stream):
            for start in range(0, n, chunk.numel()):
                k = min(chunk.numel(), n - start)
                chunk[:k].copy_(src[start:start + k], non_blocking=True)
                dst[start:start + k].copy_(chunk[:k])
        return
    half = chunk.numel() // 2
    halves = (chunk[:half], chunk[half:2 * half])
    cast_done = [None, None]
    for i, start in enumerate(range(0, n, half)):
        k = min(half, n - start)
        buf = halves[i % 2]
        copied = torch.cuda.Event()
        with torch.cuda.stream(copy_stream):
            if cast_done[i % 2] is not None:
                copy_stream.wait_event(cast_done[i % 2])  # the half's last cast has read it
            buf[:k].copy_(src[start:start + k], non_blocking=True)
            copied.record(copy_stream)
        with torch.cuda.stream(cast_stream):
            cast_stream.wait_event(copied)
            dst[start:start + k].copy_(buf[:k])
            cast_done[i % 2] = torch.cuda.Event()
            cast_done[i % 2].record(cast_stream)
    copy_stream.wait_stream(cast_stream)


def timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--region", type=float, default=2e8, help="fp32 parameters per region")
    p.add_argument("--regions", type=int, default=8)
    p.add_argument("--mm", default="16384,3072,8192", help="m,k,n of the busy stream's matmul")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    n = int(args.region)
    src = torch.randn(n, pin_memory=True)
    dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    chunk = torch.empty(CHUNK, device="cuda")
    m, k, nn = (int(x) for x in args.mm.split(","))
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, nn, device="cuda", dtype=torch.bfloat16)
    mm_flops = 2 * m * k * nn
    compute = torch.cuda.current_stream()
    mm_alone = statistics.median(timed(lambda: [a @ b for _ in range(50)]) for _ in range(3)) / 50
    rows = []
    for name, priority, split in (("serial", False, False), ("priority", True, False),
                                  ("split", False, True), ("split+priority", True, True)):
        copy_stream, cast_stream = _streams(priority)

        def copies():
            for _ in range(args.regions):
                fetch(src, dst, chunk, copy_stream, cast_stream, split)
            compute.wait_stream(copy_stream)

        copies()  # warm
        alone = statistics.median(timed(copies) for _ in range(args.repeats))
        beside, mm_beside = [], []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cstart, cend = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            count = max(1, int(alone / mm_alone * 1.5))  # matmuls outlast the copies
            cstart.record(compute)
            with torch.cuda.stream(copy_stream):
                copy_stream.wait_event(cstart)
                start.record(copy_stream)
                for _ in range(args.regions):
                    fetch(src, dst, chunk, copy_stream, cast_stream, split)
                end.record(copy_stream)
            for _ in range(count):
                a @ b
            cend.record(compute)
            torch.cuda.synchronize()
            beside.append(start.elapsed_time(end) / 1e3)
            mm_beside.append(cstart.elapsed_time(cend) / 1e3 / count)
        fp32_bytes = 4 * n * args.regions
        row = {"bench": "weight_copies", "variant": name, "gpu": torch.cuda.get_device_name(),
               "region_params": n, "regions": args.regions, "mm": [m, k, nn],
               "copy_gbs_alone": fp32_bytes / alone / 1e9,
               "copy_gbs_beside_matmuls": fp32_bytes / statistics.median(beside) / 1e9,
               "matmul_tflops_alone": mm_flops / mm_alone / 1e12,
               "matmul_tflops_beside_copies": mm_flops / statistics.median(mm_beside) / 1e12}
        rows.append(row)
        print(f"{name:15s} copy GB/s alone {row['copy_gbs_alone']:5.1f}  beside matmuls "
              f"{row['copy_gbs_beside_matmuls']:5.1f}   matmul TFLOP/s alone "
              f"{row['matmul_tflops_alone']:5.0f}  beside {row['matmul_tflops_beside_copies']:5.0f}")
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

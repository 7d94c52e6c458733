"""The parent's summary of a bench/train.py run: the table printed after the last system
(tokens/s, TFLOP/s, MFU, memory, the step bound and how near each system came to it, the
planner's prediction against the measurement, where host memory and time went) and a
row's memory-at-peak tables. Reads rows only: the same rows bench/readme_table.py renders."""

from __future__ import annotations

HOST_BYTES_PER_PARAM = 34  # fp32 master+m+v read+write, bf16 weight and gradient copies


def _bound(row: dict, probe: dict, compiled_step: float | None) -> dict:
    """The step-time bound of issue 6: max(compute, host memory traffic, PCIe). Parameters
    whose AdamW state stays on the GPU (updates="resident") cross no host memory, so the
    host term counts only the others."""
    host_params = row["params"] - (row.get("resident_params") or 0)
    # the faster allocation's rate: megatrain's state sits on huge pages where they help
    adamw_gbs = max(probe["adamw_gbs"], probe.get("adamw_huge_pages_gbs") or 0)
    host_s = HOST_BYTES_PER_PARAM * host_params / (adamw_gbs * 1e9)
    pcie_s = max(row.get("h2d_bytes", 0), row.get("d2h_bytes", 0)) / (probe["h2d_gbs"] * 1e9)
    terms = {"bound_compute_s": compiled_step, "bound_host_s": host_s, "bound_pcie_s": pcie_s}
    bound = max(v for v in terms.values() if v is not None)
    return {**terms, "bound_s": bound, "fraction_of_bound": bound / row["step_s"]}


def print_table(rows: list[dict], probe: dict | None, depths: list) -> None:
    """The summary table of a run's rows, one line per system and its detail lines below."""
    compiled_at = {r["layers"]: r["step_s"] for r in rows if r["system"] == "resident-compiled" and "step_s" in r}
    print(f"probe: {probe}")
    print(f"{'system':18s} {'tok/s':>8s} {'TFLOP/s':>7s} {'MFU':>5s} {'step s':>6s} {'GPU GiB':>7s} "
          f"{'RSS GiB':>7s} {'B/par':>5s} {'vs comp':>7s} {'stall s':>7s} {'optw s':>6s} {'PCIe':>5s} {'bound':>5s}")
    for r in rows:
        name = r.get("variant", r["system"])
        name = f"{name} L{r['layers']}" if len(depths) > 1 else name
        if "error" in r:
            print(f"{name:18s} error: {r['error']}")
            continue
        compiled = compiled_at.get(r["layers"])
        b = _bound(r, probe, compiled) if probe and "error" not in probe else {}
        f = lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "-"  # noqa: B023 (called in this iteration)
        print(f"{name:18s} {r['tokens_per_s']:8.0f} {r['tflops']:7.1f} {f('mfu', '5.2f')} "
              f"{r['step_s']:6.3f} {f('peak_gpu_gib', '7.1f')} {r['host_rss_gib']:7.1f} "
              f"{f('host_bytes_per_param', '5.1f')} {(compiled / r['step_s']) if compiled else float('nan'):7.2f} {f('transfer_stall_s', '7.3f')} "
              f"{f('optimizer_wait_s', '6.3f')} {f('pcie_gbs', '5.1f')} "
              f"{b.get('fraction_of_bound', float('nan')):5.2f}")
        if b:
            print(f"{'':18s} bound terms: " + ", ".join(f"{k[6:]}={v:.3f}" for k, v in b.items()
                                                         if k.startswith("bound_") and v is not None))
        if r.get("predicted_step_s"):
            print(f"{'':18s} planner predicted {r['predicted_step_s']:.3f} s/step "
                  f"(measured/predicted {r['step_s'] / r['predicted_step_s']:.2f}, rates of {r.get('planned_with')})")
            print(f"{'':18s} per step predicted/measured: compute {r['predicted_compute_s']:.3f}/"
                  f"{r['measured_compute_s']:.3f} s, host updates {r['predicted_host_s']:.3f}/"
                  f"{r.get('host_busy_s') or 0:.3f} s, gradient copies {r['predicted_d2h_s']:.3f}/"
                  f"{r['measured_d2h_s']:.3f} s, weight copies {r['predicted_h2d_s']:.3f}/{r['h2d_busy_s']:.3f} s")
        if r.get("h2d_copy_gbs"):
            print(f"{'':18s} host blocked: on gradient slabs {r.get('slab_wait_s', 0):.3f} s, on host casts "
                  f"{r.get('cast_wait_s', 0):.3f} s; weight fetch paths {r.get('fetch_paths')}; "
                  f"reserve beside the plan {r.get('update_reserve_bytes', 0) / 2**30:.2f} GiB "
                  f"(planned {(r.get('update_reserve_planned_bytes') or 0) / 2**30:.2f}), "
                  f"regions backlogged over the run {r.get('backlogged_regions_total')}, "
                  f"deferred at the last backward's end {r.get('deferred_regions')}; "
                  f"resident regions {r.get('resident_regions')} "
                  f"({(r.get('resident_bytes') or 0) / 2**30:.2f} GiB, sent home {r.get('resident_demoted')}), "
                  f"device-update sites {r.get('device_update_sites')}")
            phases = r.get("host_updates_by_phase") or {}
            if phases:
                print(f"{'':18s} host updates by phase (G params/s): " + ", ".join(
                    f"{k} {v['updates']} in {v['busy_s']:.3f} s ({v['params'] / max(v['busy_s'], 1e-9) / 1e9:.2f})"
                    for k, v in phases.items()))
            print(f"{'':18s} weight copies: {r['h2d_busy_s']:.3f} s busy at {r['h2d_copy_gbs']:.1f} GB/s; "
                  f"stall by region: {r.get('stall_by_region')}")
        if r.get("host_bytes_per_param_phases"):
            print(f"{'':18s} host B/param (peak/now/anon), GiB (shmem/pinned allocator): " + ", ".join(
                f"{k} {v['peak']:.2f}/{v['now']:.2f}/{v.get('anon', float('nan')):.2f}"
                f" ({v.get('shmem_gib', float('nan')):.2f}/{v.get('pinned_gib', float('nan')):.2f})"
                for k, v in r["host_bytes_per_param_phases"].items()))
        if r.get("host_anon_huge_gib") is not None:
            print(f"{'':18s} anonymous memory on huge pages at the end: {r['host_anon_huge_gib']:.1f} GiB")
        if r.get("host_largest_mappings"):
            print(f"{'':18s} RssFile/RssShmem GiB {r['host_rss_file_shmem_gib']}, largest "
                  f"non-anonymous mappings: {r['host_largest_mappings']}; torch pinned allocator "
                  f"{r.get('pinned_allocator')}; gradients outside the slabs "
                  f"{r.get('grad_own_buffers')}, page-lock failures {r.get('page_lock_failures')}; "
                  f"gradient slabs {r.get('grad_slab_bytes')} B, ring {r.get('grad_ring_bytes')} B")
        if r.get("pinned_holders"):
            print(f"{'':18s} pinned blocks held at the end: {r['pinned_holders']}")
        for ev in r.get("pinned_growth") or []:
            print(f"{'':18s} pinned allocator {ev['from_bytes']} -> {ev['to_bytes']} B in {ev['phase']}; stacks:")
            for tid, frames in ev["stacks"].items():
                print(f"{'':20s}thread {tid}: " + " <- ".join(reversed(frames[-6:])))
        print(f"{'':18s} host time in calls: " + ", ".join(
            f"{k[:-2]}={r[k]:.3f}" for k in ("forward_call_s", "backward_call_s", "optimizer_call_s",
                                               "final_sync_s") if k in r))


def _print_memory_at_peak(m: dict) -> None:
    """A row's memory_at_peak (_memory_at_peak) as two tables: by allocated bytes, then by
    active bytes (frees waiting on record_stream events still count)."""
    from memory_peak import summary_table

    g = 2**30
    print(f"{'':18s} memory at the extra step's peak: replayed {m['peak_bytes'] / g:.2f} GiB allocated, "
          f"max_memory_allocated {m['max_memory_allocated'] / g:.2f} GiB; replayed "
          f"{m['active_peak_bytes'] / g:.2f} GiB active, peak active {(m['max_active_bytes'] or 0) / g:.2f} GiB; "
          f"{m['trace_entries']} events" + (" (ring buffer full: the peak may be older)" if m["trace_full"] else ""))
    for title, total, groups in (("allocated at the peak", m["peak_bytes"], m["groups"]),
                                 ("active at the active peak (frees waiting on record_stream count)",
                                  m["active_peak_bytes"], m["active_groups"])):
        print("\n".join(f"{'':20s}{line}" for line in summary_table(total, groups, title).splitlines()))


"""The machine probe: measures positive rates on the CPU device, caches them per device."""

from __future__ import annotations

import json

import pytest
import torch

from megatrain.plan.costs import Rates
from megatrain.runtime import probe
from megatrain.runtime.grad_copies import GRAD_TRANSFER_DTYPE

TINY = probe.ProbeSizes(copy_bytes=1 << 20, matmul_n=64, adamw_params=1 << 14, repeats=1)


def test_probe_measures_and_caches_by_device_name(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    rates = probe.load_or_probe("cpu", sizes=TINY)
    assert rates.device == probe.device_name("cpu")
    assert all(getattr(rates, k) > 0 for k in ("h2d", "d2h", "duplex", "flops", "adamw", "memory"))
    path = probe.cache_path(rates.device)
    assert path.parent == tmp_path
    data = json.loads(path.read_text())
    assert Rates.from_json(data["rates"]) == rates and data["meta"]["adamw_impl"] == probe._update_timed(torch.float32)

    def no_measuring(*a, **k):
        raise AssertionError("measured again despite a cache")

    monkeypatch.setattr(probe, "probe", no_measuring)
    assert probe.load_or_probe("cpu") == rates  # from the cache
    with pytest.raises(AssertionError, match="measured again"):
        probe.load_or_probe("cpu", refresh=True)


def test_unreadable_cache_is_measured_over(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    path = probe.cache_path(probe.device_name("cpu"))
    path.write_text("{not json")
    rates = probe.load_or_probe("cpu", sizes=TINY)
    assert json.loads(path.read_text())["rates"]["device"] == rates.device


def test_cache_from_before_a_rate_was_measured_is_measured_over(tmp_path, monkeypatch):
    """A cache without the device memory rate is not trusted with a guess: measured again."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    path = probe.cache_path(probe.device_name("cpu"))
    old = {"device": probe.device_name("cpu"), "h2d": 1e9, "d2h": 1e9, "duplex": 1e9,
           "flops": 1e9, "adamw": 1e9}
    path.write_text(json.dumps({"rates": old}))
    rates = probe.load_or_probe("cpu", sizes=TINY)
    assert rates.memory > 0 and json.loads(path.read_text())["rates"]["memory"] == rates.memory


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGATRAIN_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert probe.cache_dir() == tmp_path / ".cache" / "megatrain"


def test_the_first_compile_measures_the_machine_once(tmp_path, monkeypatch):
    """A user who never calls the probe still plans with this machine's rates: the first
    compile measures and caches them, later compiles read the cache."""
    import torch

    import megatrain
    from megatrain.compiler import rates as rates_mod

    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(probe.ProbeSizes, "for_device", classmethod(lambda cls, d: TINY))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    with megatrain.config.patch(probe_rates=True, lowering="eager"):
        torch.compile(model, backend="megatrain", options={"device": "cpu"})(x).sum().backward()
        measured = rates_mod.cached_rates(torch.device("cpu"))
        assert measured is not None and measured.device == probe.device_name("cpu")
        assert megatrain.explain().graphs[0].schedule.rates == measured

        def no_measuring(*a, **k):
            raise AssertionError("measured again despite a cache")

        monkeypatch.setattr(probe, "probe", no_measuring)
        torch._dynamo.reset()
        torch.compile(model, backend="megatrain", options={"device": "cpu"})(x).sum().backward()


def test_adamw_rate_is_measured_at_the_optimizers_threads(tmp_path, monkeypatch):
    """The cost model charges host updates at the probe's AdamW rate, so the probe times
    the update at the threads the host optimizer gets beside a streamed step, whatever the
    process default, and leaves that default as it was."""
    import torch

    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    before = torch.get_num_threads()
    monkeypatch.setattr(probe, "streaming_threads", lambda device_type: 1)
    seen = []
    timed = probe._timed

    def spy(device, work):
        seen.append(torch.get_num_threads())
        return timed(device, work)

    monkeypatch.setattr(probe, "_timed", spy)
    torch.set_num_threads(2)
    try:
        probe.load_or_probe("cpu", sizes=TINY)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    meta = json.loads(probe.cache_path(probe.device_name("cpu")).read_text())["meta"]
    assert meta["adamw_threads"] == 1 and meta["adamw_beside"] == "nothing"
    assert 1 in seen and 2 in seen  # the AdamW timing at 1 thread, the rest at the default


@pytest.mark.parametrize("stale", ["threads", "beside", "older probe", "torch's optimizer", "other grads"])
def test_a_cache_taken_otherwise_is_measured_over(tmp_path, monkeypatch, stale):
    """A cached update rate taken at other threads, beside other traffic, of another update
    (torch.optim.AdamW on torch's own pages, not megatrain.AdamW's kernel on its state's
    memory), or by a probe that recorded none of these is not the rate the cost model
    needs: it is measured again."""
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    rates = probe.load_or_probe("cpu", sizes=TINY)
    path = probe.cache_path(rates.device)
    data = json.loads(path.read_text())
    if stale == "threads":
        data["meta"]["adamw_threads"] += 1
    elif stale == "beside":
        data["meta"]["adamw_beside"] = "duplex copies"
    elif stale == "torch's optimizer":
        data["meta"]["adamw_impl"] = "fused"
    elif stale == "other grads":  # bf16 gradients, a path training does not run here
        data["meta"]["adamw_impl"] = probe._update_timed(torch.bfloat16)
    else:
        del data["meta"]["adamw_threads"], data["meta"]["adamw_beside"], data["meta"]["adamw_impl"]
    path.write_text(json.dumps(data))

    def measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(probe, "probe", measuring)
    with pytest.raises(AssertionError, match="measured again"):
        probe.load_or_probe("cpu")


def test_streaming_threads_leave_the_gpu_half_the_cores():
    import torch

    from megatrain.optim.engine import streaming_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert (streaming_threads("cuda"), streaming_threads("cpu")) == (1, 2)
        torch.set_num_threads(1)
        assert (streaming_threads("cuda"), streaming_threads("cpu")) == (1, 1)
    finally:
        torch.set_num_threads(before)


def test_the_probe_times_megatrains_update_on_its_states_memory(tmp_path, monkeypatch):
    """The rate the cost model charges is the update that runs: optim.functional.adamw_
    (what megatrain.AdamW calls) on buffers from memory.host_store.host_zeros (where the
    optimizer's masters and moments live), at the probe's size."""
    import torch

    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path))
    sizes = probe.ProbeSizes(copy_bytes=1 << 20, matmul_n=64, adamw_params=1 << 20, repeats=1)
    calls, zeros = [], []
    real_update, real_zeros = probe.adamw_, probe.host_zeros

    def update(params, grads, *rest, **hyper):
        calls.append([p.numel() for p in params])
        return real_update(params, grads, *rest, **hyper)

    def host_zeros(numel, dtype):
        zeros.append((numel, dtype))
        return real_zeros(numel, dtype)

    monkeypatch.setattr(probe, "adamw_", update)
    monkeypatch.setattr(probe, "host_zeros", host_zeros)
    probe.load_or_probe("cpu", sizes=sizes)
    assert calls and all(c == [sizes.adamw_params] for c in calls)
    assert zeros == [(sizes.adamw_params, torch.float32)] * 4  # param, grad, m, v


def test_the_update_is_timed_with_the_gradients_training_hands_it():
    """The probe times the update with the gradients' dtype as they cross the link from a GPU
    (the dtype the runtime's gradient copies write; its cache entry says which, so a cache
    of another path is measured again), fp32 on the CPU; both paths time."""
    assert probe.grad_dtype(torch.device("cuda")) == GRAD_TRANSFER_DTYPE
    assert probe.grad_dtype(torch.device("cpu")) == torch.float32
    for dtype in (torch.float32, torch.bfloat16):
        rate, quiet, impl, busy = probe._adamw_rates(torch.device("cpu"), 1 << 16, 1, 1, 1 << 16, grads=dtype)
        assert rate > 0 and quiet is None and busy
        assert impl.endswith(f"{str(dtype).removeprefix('torch.')} grads")

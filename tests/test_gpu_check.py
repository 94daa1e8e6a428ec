"""bench/gpu_check.py --cpu-smoke, each in its own process (so the import check means something):
the same code as on a GPU, on tiny shapes. The correctness, tensor_parallel and tier_noreuse sections
are left out: the first is these files' engine tests on a GPU-free machine; the second needs two GPUs
(the machine a session is lent has one, so it is skipped there) and its checks, greedy == HF on two
ranks, a host-tier round trip on two ranks, decode on two ranks, are tests/test_tensor_parallel.py's
on gloo ranks (here it would take ~70 s of the test's ~80); the third is a throughput ratio."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import CPU_SMOKE, SECTIONS

ROOT = Path(__file__).parent.parent


def run_smoke(tmp_path: Path, sections: list[str]) -> dict:
    out = tmp_path / "r.json"
    skip = [a for name in SECTIONS if name not in sections for a in ("--skip", name)]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu-smoke",
                           "--out", str(out), *skip],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["forbidden_modules_loaded"] == [] and r["failed_sections"] == []
    assert r["host_cpu"].split(",")[0] in Path("/proc/cpuinfo").read_text()  # (its model name)
    assert "GPU criteria" in proc.stdout
    return r


def test_gpu_check_cpu_smoke(tmp_path):
    """The speed section with every backend (Triton interpreted) counts decode tokens from the
    engine while the batch stays full; the quant section's kernels meet their bounds and its
    quantized twins of the small model generate; the tier round trip and TTFT outputs check out;
    copies run both ways; steps are timed while a host load is in flight and the loader's tokens
    equal the device-cache run's; a host prefix is admitted and its copies counted; nothing on the path
    imports pyzmq, fastapi, gguf, the embedded model package or test code."""
    r = run_smoke(tmp_path, ["speed", "quant", "tier_round_trip", "tier_ttft", "tier_bandwidth",
                             "tier_overlap", "tier_admission"])
    batches, steps = CPU_SMOKE.batches, CPU_SMOKE.decode_steps
    for backend in ("flash", "triton", "torch"):
        rows = r["speed"][backend]["eager"]
        assert [rows[f"batch_{b}"]["tokens"] for b in batches] == [b * steps for b in batches]
        assert all(row["tok_s"] > 0 and row["roofline_tok_s"] > 0 for row in rows.values())
        # the forward's busy time within the step, the rest the host's gap; the serial A/B on the same engine
        assert all(0 < row["busy_ms"] and row["gap_ms"] >= 0 and row["serial_tok_s"] > 0
                   and row["kernels_per_step"] > 0 for row in rows.values())
    q = r["quant"]  # every quantized kernel within its bound of its own dequantized weight; the twins ran
    assert q["kernels_ok"] and [len(shape) for shape in q["kernels"].values()] == [3, 3]
    assert all({"bf16", "q8_0", "fp8", "fp8_triton"} <= set(row)
               for shape in q["kernels"].values() for row in shape.values())
    assert set(q["agreement"]) == {"q8_0", "fp8"}
    assert all(a["argmax_agreement"] > 0.5 for a in q["agreement"].values())
    assert r["tier_round_trip"]["exact"] and r["tier_round_trip"]["bytes_each_way"] > 0
    assert [row["outputs_match"] for row in r["tier_ttft"]["rows"]] == [True] * len(CPU_SMOKE.ttft_lens)
    assert all(row["host_cached"] > 0 for row in r["tier_ttft"]["rows"])
    bw = r["tier_bandwidth"]
    assert all(bw[f"{k}_gb_s"] > 0 for k in ("tier_save", "tier_load", "raw_d2h", "raw_h2d"))
    assert bw["copy_failures"] == 0
    ov = r["tier_overlap"]
    assert ov["in_flight_steps"] > 0 and ov["quiet_steps"] == CPU_SMOKE.overlap_loads * CPU_SMOKE.quiet_steps
    assert ov["ratio"] > 0 and ov["outputs_equal"] and ov["host_loaded"]
    ad = r["tier_admission"]  # the host prefix was admitted, its load started, with the server's copier
    assert ad["load_blocks"] == CPU_SMOKE.admission[0] and ad["admit_ms"] > 0 and 1 <= ad["copies"] <= 16
    assert ad["stages_ms"]["load start"] > 0
    overlap, host_hit, admission = [c for c in r["gpu_criteria"] if c["timing"]]
    # the figures are measured; the bounds are not judged on CPU
    assert None not in (overlap["passed"], host_hit["passed"], admission["passed"])


@pytest.mark.server
def test_gpu_check_server_cpu_smoke(tmp_path):
    """The server section: `nanoserve` on a dummy-weight folder with a BPE tokenizer trained in the
    check, documents worth 4x the device tier twice at concurrency 4: every request streams text,
    round 2 finds prompt tokens cached, no KV copy fails, SIGTERM stops the server cleanly."""
    s = run_smoke(tmp_path, ["server"])["server"]
    assert s["tokenizer"]["round_trip"] and s["tokenizer"]["vocab"] == CPU_SMOKE.big["vocab_size"]
    n = s["workload"]["documents"]
    assert s["workload"]["prompt_tokens"] >= 4 * s["workload"]["device_tier_tokens"]
    assert s["round_1"]["answered"] == s["round_2"]["answered"] == n
    assert s["round_2"]["cached_share"] > 0 and s["round_2"]["host_cached_tokens"] > 0
    assert s["kv_transfer_failures"] in (0, "missing")
    assert s["stop"]["clean_exit"]

"""`--backend ray-data` when Ray's own out-of-memory killer kills an actor: the run stops with one line naming the
cause, the shards kept and the rows in no shard; the rerun fills the rest.

A one-node Ray is started for this test. Its worker processes get a `sitecustomize` (from the test's tmp folder, on
their PYTHONPATH) that wraps `compute_shard`: while a flag file exists, the shard holding source index `TARGET`
allocates memory (64 MiB at a time, every page written) until the killer ends the actor, each of the times Ray
restarts it and retries the block. Removing the flag makes the workers compute normally again, so the rerun is the
same command on the same cluster.

Ray's memory monitor compares `used` with `RAY_memory_usage_threshold` × `total`, both read from the cgroup at
/sys/fs/cgroup when that cgroup has a memory limit, else from the whole machine (/proc/meminfo). Two ways to give it
numbers that only this cluster moves:

- **cgroup** (root, a writable cgroup v1 memory hierarchy, `unshare`): the cluster runs in a cgroup of its own with a
  `LIMIT` byte memory limit, in a mount namespace where that cgroup is bind-mounted over /sys/fs/cgroup/memory, so
  the killer counts only the cluster's processes and fires at `FRACTION` × `LIMIT` whatever the rest of the machine
  does. The cgroup is removed at the end. The test skips this way only when the machine has less free memory
  than `LIMIT`.
- **machine** (elsewhere): the threshold sits `MARGIN` above what the whole machine uses when the test starts, so
  other processes' use moving by gigabytes meanwhile can make the killer fire before the target shard, or not at
  all: the test then skips, and it skips from the start when the machine has too little free memory for the margin.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.corpus.test_corpus import synth
from tests.corpus.test_corpus_raydata import _free_port, _ray_bin, _suppress, _wait_port

pytest.importorskip("ray.data")

N, SHARD, TARGET = 24, 8, 16
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
# cgroup: the cluster (raylet, GCS, one actor with its model, the tokenising tasks) peaks near 1.7 GiB when no hook
# allocates, so the killer fires with about 1.5 GiB allocated by the hook; the kernel's own limit (LIMIT) is 1.75
# GiB further, out of reach of what the hook allocates between two of the monitor's 100 ms checks.
LIMIT, FRACTION = 5 << 30, 0.65
# machine: where the threshold sits above the machine's use when the test starts (room for this cluster and its
# actor's model, and for other processes' use to grow meanwhile).
MARGIN = 6 << 30

HOOK = """
import os, sys, time
if os.environ.get("MIXLENS_OOM_FLAG") and "default_worker" in " ".join(sys.argv):
    import numpy as np
    import mixlens.corpus.compute as compute

    _orig = compute.compute_shard

    def compute_shard(lens, job, shard_id, examples, **kw):
        if os.path.exists(os.environ["MIXLENS_OOM_FLAG"]) and any(e.index == {target} for e in examples):
            hold = []
            while sum(a.nbytes for a in hold) < {cap}:
                hold.append(np.ones(64 << 20, np.uint8))
                time.sleep(0.02)
            time.sleep(20)  # still alive: the killer did not fire
        return _orig(lens, job, shard_id, examples, **kw)

    compute.compute_shard = compute_shard
"""


def _used_bytes() -> tuple[int, int]:
    """(total, used = total - available) of this machine's memory, as Ray's memory monitor counts them."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":")
        info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"], info["MemTotal"] - info["MemAvailable"]


def _enter_cgroup() -> list[str]:
    """The command prefix that starts a process in the cgroup given as its first argument, in a mount namespace
    where that cgroup is the memory hierarchy's root."""
    script = 'echo $$ > "$1/cgroup.procs" && mount --bind "$1" /sys/fs/cgroup/memory && shift && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


@contextlib.contextmanager
def _memory_cgroup() -> Iterator[Path | None]:
    """A fresh cgroup v1 memory cgroup limited to LIMIT bytes, whose processes are killed and which is removed at
    the end; None where one cannot be made and entered here (not root, no cgroup v1 memory hierarchy, read-only
    cgroupfs, no `unshare`, no mount namespaces)."""
    if os.geteuid() != 0 or not (CGROUP_V1 / "memory.limit_in_bytes").exists() or not shutil.which("unshare"):
        yield None
        return
    cg = CGROUP_V1 / f"mixlens-test-oom-{os.getpid()}"
    try:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(LIMIT))
    except OSError:
        with contextlib.suppress(OSError):
            cg.rmdir()
        yield None
        return
    try:
        probe = subprocess.run([*_enter_cgroup(), str(cg), "true"], capture_output=True, timeout=30, check=False)
        yield cg if probe.returncode == 0 else None
    finally:
        for _ in range(50):  # Ray's processes may outlive the head's process group by a moment
            pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
            for pid in pids:
                with _suppress():
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                cg.rmdir()
                break
            time.sleep(0.2)


@pytest.fixture
def oom_cluster(tmp_path):
    """(address, flag file, env, how): a one-node Ray whose memory killer fires on what the hook allocates (how:
    'cgroup' or 'machine', see the module's docstring)."""
    with _memory_cgroup() as cg:
        total, used = _used_bytes()
        if cg is not None and used + LIMIT > total:
            pytest.skip("less free memory on this machine than the memory limit of the test cluster's cgroup")
        if cg is not None:
            how, prefix, threshold, cap = "cgroup", [*_enter_cgroup(), str(cg)], FRACTION, LIMIT
        elif used + MARGIN > total * 0.85:
            pytest.skip("not enough free memory on this machine to provoke Ray's out-of-memory killer safely")
        else:
            how, prefix, threshold, cap = "machine", [], (used + MARGIN) / total, MARGIN + (3 << 30)
        hook = tmp_path / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(HOOK.format(target=TARGET, cap=cap))
        flag = tmp_path / "oom-on"
        flag.write_text("1")
        temp = tempfile.mkdtemp(prefix="mxoom")  # short: Ray's socket paths must stay under 107 characters
        port = _free_port()
        env = {
            **os.environ,
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_memory_usage_threshold": f"{threshold:.4f}",
            "RAY_memory_monitor_refresh_ms": "100",
            "RAY_count_swap_in_memory_monitor": "0",  # RAM only, so that the cgroup's memory limit is the total
            "RAY_task_oom_retries": "2",  # Ray's default retries a task its killer ended without end
            "MIXLENS_OOM_FLAG": str(flag),
            "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.Popen(
            [*prefix, _ray_bin(), "start", "--head", "--block", "--port", str(port), "--num-cpus", "2", "--temp-dir",
             temp, "--include-dashboard", "false", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
             "--object-store-memory", str(200 << 20)],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            _wait_port(port)
            time.sleep(3)  # the raylet registers after the GCS port opens
            yield f"127.0.0.1:{port}", flag, env, how
        finally:
            if how == "machine":  # in a cgroup, every process of the cluster is killed with it
                with _suppress():
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(30)
            with _suppress():
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            subprocess.run(["rm", "-rf", temp], check=False)


def _cmd(data: Path, model: str, out: Path, address: str) -> list[str]:
    return [sys.executable, "-m", "mixlens", "corpus", "--data", str(data), "--model", model, "--out", str(out),
            "--shard-size", str(SHARD), "--backend", "ray-data", "--address", address, "--concurrency", "1",
            "--quiet", "--method", "norm"]  # fmt: skip


def _run(cmd: list[str], env: dict[str, str], how: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired:
        if how == "cgroup":
            raise
        pytest.skip("the run did not end in 400 s (Ray's killer ending workers again and again: the machine is full)")


def _unsteady(how: str, why: str) -> None:
    """Skip where the killer counts the whole machine (other processes moved it); fail where it counts our cgroup."""
    if how == "machine":
        pytest.skip(f"{why} (Ray's memory monitor counts the whole machine, whose use changed meanwhile)")
    pytest.fail(f"{why}, in a cgroup of this cluster's own")


@pytest.mark.slow  # a Ray cluster, an actor killed three times (about a minute)
def test_actor_killed_by_rays_oom_killer(oom_cluster, tmp_path, tokenizer):
    from mixlens.corpus import CorpusResult
    from tests.conftest import random_model

    address, flag, env, how = oom_cluster
    model = tmp_path / "tiny"
    random_model("bert", tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    data = synth(tmp_path / "d.tsv", N)
    out = tmp_path / "out"
    run = _run(_cmd(data, str(model), out, address), env, how)
    if run.returncode == 0:
        _unsteady(how, "Ray's out-of-memory killer did not fire")
    shards = sorted((out / "shards").glob("shard-*.parquet"))
    kept = sorted(i for p in shards for i in pq.read_table(p, columns=["index"])["index"].to_pylist())
    if not kept and "out-of-memory killer" in run.stderr:
        _unsteady(how, "Ray's out-of-memory killer fired before the first shard")
    # one line of ours; Ray's C++ core may add its own warning lines above it, never a traceback
    err = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and err.startswith("mixlens: error: the Ray Data run stopped"), run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "out-of-memory killer" in err and "rerun the same command" in err, err
    assert TARGET not in kept and len(kept) == len(set(kept))  # finished shards are kept
    lost = sorted(set(range(N)) - set(kept))
    assert f"{len(shards)} shards ({len(kept)} examples) are kept" in err, err
    assert f"{len(lost)} of {N} rows are in no shard (source indexes " in err, err
    flag.unlink()  # the workers compute normally again
    again = _run(_cmd(data, str(model), out, address), env, how)
    if again.returncode == 2 and "out-of-memory killer" in again.stderr:
        _unsteady(how, "Ray's out-of-memory killer fired in the rerun")
    assert again.returncode == 0, again.stderr[-3000:]
    res = CorpusResult.open(out)
    assert res.manifest["complete"] and res.manifest["resumed_shards"] == len(shards)
    assert sorted(res.examples(columns=["index"])["index"].tolist()) == list(range(N))  # none duplicated or missing

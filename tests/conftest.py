import os

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

from tandem.testing import build_tiny_pair

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target folder, draft folder): tiny seeded Llamas sharing a tokenizer."""
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"))


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

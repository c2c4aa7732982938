"""The Redis registry and session store against a real, private redis-server; the KV keeper alone."""

import asyncio
import json
import time

import pytest
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from tandem.cluster import registry
from tandem.cluster.redis_conn import RedisServer, check_url, connect, redacted
from tandem.cluster.registry import DRAFT, VERIFY, Heartbeat, Registry, WorkerInfo
from tandem.cluster.sessions import SessionRecord, SessionStore
from tandem.engine.kvpool import KVPool, SessionCache
from tandem.speculation.sampling import SamplingParams
from verify_worker.engine import TargetSession
from verify_worker.kvstore import KVBudgetExceeded, SessionKeeper


@pytest.mark.system
async def test_register_list_and_deregister(redis_client):
    reg = Registry(redis_client)
    await reg.register(WorkerInfo("h:1", VERIFY, "m", load=2), ttl=5)
    await reg.register(WorkerInfo("h:2", VERIFY, "m"), ttl=5)
    await reg.register(WorkerInfo("h:3", DRAFT, "m", methods=["ngram"]), ttl=5)
    assert sorted(w.address for w in await reg.workers(VERIFY)) == ["h:1", "h:2"]
    assert [w.methods for w in await reg.workers(DRAFT)] == [["ngram"]]
    assert {w.address: w.load for w in await reg.workers(VERIFY)}["h:1"] == 2
    await reg.deregister(VERIFY, "h:1")
    assert [w.address for w in await reg.workers(VERIFY)] == ["h:2"]


@pytest.mark.system
async def test_a_worker_that_stops_beating_expires(redis_client):
    reg = Registry(redis_client)
    beat = Heartbeat(reg, lambda: WorkerInfo("h:9", VERIFY, "m"), interval=0.1)
    await beat.start()
    assert 0 < await redis_client.pttl("tandem:worker:verify:h:9") <= 300      # TTL = three intervals
    await asyncio.sleep(0.35)
    assert [w.address for w in await reg.workers(VERIFY)] == ["h:9"]   # renewed past the first TTL
    beat._task.cancel()                                                 # dies without deregistering
    await asyncio.sleep(0.4)
    assert await reg.workers(VERIFY) == []
    assert await redis_client.smembers("tandem:workers:verify") == set()      # the index is pruned too


@pytest.mark.system
async def test_clean_stop_deregisters_at_once(redis_client):
    reg = Registry(redis_client)
    beat = Heartbeat(reg, lambda: WorkerInfo("h:8", DRAFT, "m"), interval=10)
    await beat.start()
    assert len(await reg.workers(DRAFT)) == 1
    await beat.stop()
    assert await reg.workers(DRAFT) == []


@pytest.mark.system
async def test_session_record_round_trip_ttl_and_lock(redis_client):
    store = SessionStore(redis_client, ttl=60, lock_ttl=5)
    assert await store.get("s1") is None
    await store.save(SessionRecord("s1", tokens=[1, 2, 3], verify="h:1", turns=1))
    await redis_client.pexpire("tandem:session:s1", 1000)
    rec = await store.get("s1")                                         # use refreshes the TTL
    assert (rec.tokens, rec.verify, rec.turns) == ([1, 2, 3], "h:1", 1)
    assert await redis_client.pttl("tandem:session:s1") > 50_000
    assert await store.lock("s1", "a") and not await store.lock("s1", "b")
    await store.unlock("s1", "b")                                       # not b's lock: kept
    assert not await store.lock("s1", "c")
    await store.unlock("s1", "a")
    assert await store.lock("s1", "c")


@pytest.mark.system
async def test_password_url_and_bad_urls():
    server = RedisServer(password="s3cret").start()
    try:
        good = connect(server.url)
        assert await good.ping()
        await good.aclose()
        bad = connect(server.url.replace("s3cret", "wrong"))
        with pytest.raises(AuthenticationError):
            await bad.ping()
        await bad.aclose()
    finally:
        server.stop()
    tls = connect("rediss://u:pw@redis.example:6380/2?ssl_ca_certs=/etc/tandem/ca.pem").connection_pool
    assert tls.connection_class.__name__ == "SSLConnection"
    assert {k: tls.connection_kwargs[k] for k in ("host", "port", "db", "username", "password", "ssl_ca_certs")} == \
        {"host": "redis.example", "port": 6380, "db": 2, "username": "u", "password": "pw",
         "ssl_ca_certs": "/etc/tandem/ca.pem"}
    assert redacted("redis://:s3cret@h:1/0") == "redis://:***@h:1/0"
    assert check_url("rediss://user:pw@redis.example:6380/0")
    with pytest.raises(ValueError, match="must start with redis://, rediss:// or unix://"):
        check_url("http://h:1")
    with pytest.raises(ValueError, match="has no host"):
        check_url("redis://")


@pytest.mark.unit
async def test_unreachable_redis_fails_fast():
    c = connect("redis://127.0.0.1:1/0")
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(RedisConnectionError):
        await c.ping()
    assert loop.time() - start < 3
    await c.aclose()


POOL = KVPool(layers=1, kv_heads=1, head_dim=1, slots=1000)


def _finished(session_id: str, n: int) -> TargetSession:
    s = TargetSession(session_id, SamplingParams(), 1, list(range(n)), SessionCache(POOL, n - 1))
    s.cache.length = n - 1
    return s


@pytest.mark.unit
def test_keeper_reuses_evicts_least_recent_and_refuses_what_cannot_fit():
    keeper = SessionKeeper(budget_tokens=100)
    assert keeper.admit(1, "a", 30) is None
    keeper.release(1, _finished("a", 31), keep=True)
    keeper.admit(2, "b", 30)
    keeper.release(2, _finished("b", 31), keep=True)
    assert list(keeper.idle) == ["a", "b"] and keeper.used() == 60
    reused = keeper.admit(3, "a", 40)                 # a's next turn takes its cache back
    assert reused is not None and reused.session_id == "a" and list(keeper.idle) == ["b"]
    keeper.release(3, _finished("a", 41), keep=True)   # a is now the most recent
    keeper.admit(4, "c", 50)                           # 40 + 30 idle + 50 > 100: b (oldest) goes
    assert list(keeper.idle) == ["a"] and keeper.evictions == 1
    with pytest.raises(KVBudgetExceeded, match="needs 101 tokens"):
        keeper.admit(5, "d", 101)
    with pytest.raises(KVBudgetExceeded, match="live sessions hold 50"):
        keeper.admit(6, "a", 60)                       # live c holds 50; a stays kept
    assert list(keeper.idle) == ["a"]
    keeper.release(4, None, keep=False)
    assert keeper.free() == 100


@pytest.mark.system
def test_local_runs_use_redis_url_then_the_default_server_then_a_private_one(monkeypatch, redis_server):
    from tandem.cluster import redis_conn
    monkeypatch.setenv("REDIS_URL", redis_server.url)
    assert redis_conn.ensure_redis() == (redis_server.url, None)
    monkeypatch.delenv("REDIS_URL")
    monkeypatch.setattr(redis_conn, "DEFAULT_URL", redis_server.url)          # one answers there
    assert redis_conn.ensure_redis() == (redis_server.url, None)
    monkeypatch.setattr(redis_conn, "DEFAULT_URL", f"redis://127.0.0.1:{redis_conn.free_port()}/0")  # silent
    url, server = redis_conn.ensure_redis()
    try:
        assert server is not None and url != redis_server.url and redis_conn.answers(url)
    finally:
        server.stop()
    assert not redis_conn.answers(url)                                        # stopped with its owner


@pytest.mark.system
async def test_router_prefers_affinity_then_room_then_least_loaded(redis_client):
    from gateway.routing import RedisRouter, RoutingError
    reg = Registry(redis_client)
    router = RedisRouter(reg, "m", "redis://test")
    for address, load, free in (("x:1", 0, 20), ("y:1", 2, 300), ("z:1", 1, 300)):
        await reg.register(WorkerInfo(address, VERIFY, "m", capacity=300, load=load, kv_free=free), ttl=5)
    await reg.register(WorkerInfo("other:1", VERIFY, "another-model"), ttl=5)
    assert await router.pick_verify("x:1", set(), need=lambda room: 10 + room) == "x:1"            # its cache is there
    assert await router.pick_verify("x:1", set(), need=lambda room: 100 + room) == "z:1"           # no room there: least loaded
    assert await router.pick_verify("", {"z:1"}, need=lambda room: 100 + room) == "y:1"
    assert await router.pick_verify("", set(), need=lambda room: 400 + room) == "x:1"              # room nowhere: least loaded
    assert await router.pick_verify("other:1", set(), need=lambda room: 1 + room) != "other:1"     # never another model
    router.failed("x:1")
    assert await router.pick_verify("x:1", set(), need=lambda room: 10 + room) == "z:1"            # just failed: skipped
    await reg.register(WorkerInfo("d:1", DRAFT, "", methods=["ngram"]), ttl=5)
    assert await router.pick_draft("ngram", set()) == "d:1"                    # model-free drafting
    assert await router.pick_draft("model", set()) is None
    with pytest.raises(RoutingError, match="no verify worker for model 'none'"):
        await RedisRouter(reg, "none", "redis://test").pick_verify("", set())


@pytest.mark.system
async def test_a_link_a_draft_worker_lists_down_is_not_paired_by_any_gateway(redis_client):
    from gateway.routing import RedisRouter
    reg = Registry(redis_client)
    router = RedisRouter(reg, "m", "redis://test")
    await reg.register(WorkerInfo("v:1", VERIFY, "m"), ttl=5)
    await reg.register(WorkerInfo("v:2", VERIFY, "m", load=5), ttl=5)
    await reg.register(WorkerInfo("d:1", DRAFT, "m", methods=["model"], links_down=["v:1"]), ttl=5)
    route = await router.route("model", affinity="v:1")
    assert (route.verify, route.draft, route.method) == ("v:1", None, "none")       # plainly, and tried again
    assert route.retry_at is not None and route.retry_at <= time.monotonic() + router.link_seconds
    route = await router.route("model", affinity="v:2")
    assert (route.verify, route.draft, route.method) == ("v:2", "d:1", "model")     # its other links are up
    await reg.register(WorkerInfo("d:1", DRAFT, "m", methods=["model"]), ttl=5)     # its probe found it up
    route = await router.route("model", affinity="v:1")
    assert (route.draft, route.method) == ("d:1", "model")


@pytest.mark.system
async def test_router_counts_the_room_a_worker_keeps_for_a_proposal(redis_client):
    from gateway.routing import RedisRouter
    reg = Registry(redis_client)
    router = RedisRouter(reg, "m", "redis://test")
    # 110 free fits a 100-token request only without the 17 positions that worker keeps for a proposal
    await reg.register(WorkerInfo("tight:1", VERIFY, "m", capacity=300, load=0, kv_free=110, kv_margin=17), ttl=5)
    await reg.register(WorkerInfo("room:1", VERIFY, "m", capacity=300, load=3, kv_free=120, kv_margin=17), ttl=5)
    assert await router.pick_verify("tight:1", set(), need=lambda room: 100 + room) == "room:1"
    assert await router.pick_verify("tight:1", set(), need=lambda room: 90 + room) == "tight:1"


@pytest.mark.system
async def test_registry_skips_fields_it_does_not_know(redis_client):
    """A worker of a newer release may register fields this gateway's WorkerInfo lacks."""
    reg = Registry(redis_client)
    await reg.register(WorkerInfo("new:1", VERIFY, "m", capacity=300), ttl=5)
    key = registry._key(VERIFY, "new:1")
    record = json.loads(await redis_client.get(key))
    await redis_client.set(key, json.dumps({**record, "some_later_field": [1, 2]}), px=5000)
    [info] = await reg.workers(VERIFY)
    assert (info.address, info.capacity) == ("new:1", 300)


@pytest.mark.system
async def test_router_counts_its_own_reservations_before_the_next_heartbeat(redis_client):
    from gateway.routing import RedisRouter
    reg = Registry(redis_client)
    router = RedisRouter(reg, "m", "redis://test")
    await reg.register(WorkerInfo("full:1", VERIFY, "m", capacity=300, load=0, kv_free=50), ttl=5)
    await reg.register(WorkerInfo("room:1", VERIFY, "m", capacity=300, load=0, kv_free=300), ttl=5)
    assert await router.pick_verify("", set(), need=lambda room: 200 + room) == "room:1"
    # A first request now holds 200 positions there; the registry still says 300 free. Room is
    # nowhere for a second one, so it goes by load, and this gateway's stream makes room:1 busier.
    router.reserved["room:1"] += 200
    router.inflight["room:1"] += 1
    assert await router.pick_verify("", set(), need=lambda room: 200 + room) == "full:1"


@pytest.mark.system
async def test_router_sends_head_requests_to_verify_workers_with_a_head(redis_client):
    """A verify worker with a trained head registers the method; "head" goes there with no draft
    worker, and falls back to plain decoding where no worker has one."""
    from gateway.routing import RedisRouter
    reg = Registry(redis_client)
    router = RedisRouter(reg, "head-model", "redis://test")
    await reg.register(WorkerInfo("plain:1", VERIFY, "head-model", load=0), ttl=5)
    fallback = await router.route("head")
    assert (fallback.verify, fallback.draft, fallback.method) == ("plain:1", None, "none")
    await reg.register(WorkerInfo("headed:1", VERIFY, "head-model", load=4, methods=["head"]), ttl=5)
    route = await router.route("head")
    assert (route.verify, route.draft, route.method) == ("headed:1", None, "head")
    assert (await router.route("none")).verify == "plain:1"          # least loaded for anything else
    router.failed("headed:1")
    assert (await router.route("head")).method == "none"             # its only head worker just failed


@pytest.mark.unit
def test_the_methods_a_verify_worker_serves_itself_are_one_list():
    """The gateway routes a verify worker's own methods with no draft worker; the verify worker
    serves exactly those, and the request's choices are the two pools' methods."""
    from gateway.request import DRAFT_METHODS
    from tandem.cluster.registry import DRAFT_POOL_METHODS, VERIFY_METHODS
    from verify_worker.rounds import OWN_METHODS
    assert set(OWN_METHODS) == set(VERIFY_METHODS)
    assert set(DRAFT_METHODS) == set(DRAFT_POOL_METHODS) | set(VERIFY_METHODS)
    assert not set(DRAFT_POOL_METHODS) & set(VERIFY_METHODS)


@pytest.mark.system
async def test_a_moved_request_keeps_to_its_first_workers_numerics(redis_client, caplog):
    """A verify worker registers its dtype and numerics; a request that moves goes on at a worker
    of its first one's numerics before any less loaded one of other numerics, and where none is
    left it moves anyway, counted."""
    from gateway.routing import RedisRouter, RoutingError
    from tandem.service import metrics
    reg = Registry(redis_client)
    for address, dtype, numerics, load in [("f32:1", "float32", "float32 x", 0), ("i8:1", "int8", "int8 x", 1),
                                           ("f32:2", "float32", "float32 x", 5), ("f32:3", "float32", "float32 y", 0)]:
        await reg.register(WorkerInfo(address, VERIFY, "num", load=load, dtype=dtype, numerics=numerics), ttl=5)
    router = RedisRouter(reg, "num", "redis://test")
    caplog.set_level("WARNING")
    first = await router.route("none", exclude={"f32:3"})
    assert (first.verify, first.numerics) == ("f32:1", "float32 x")
    assert "differ in numerics (float32 x; float32 y; int8 x)" in caplog.text
    moved = await router.route("none", exclude={"f32:1"}, numerics=first.numerics)
    assert (moved.verify, moved.numerics) == ("f32:2", "float32 x")          # not f32:3 nor i8:1, less loaded
    switches = metrics.NUMERICS_SWITCHES._value.get()
    last = await router.route("none", exclude={"f32:1", "f32:2"}, numerics=first.numerics)
    assert last.verify == "f32:3" and metrics.NUMERICS_SWITCHES._value.get() == switches + 1
    only_int8 = RedisRouter(reg, "num", "redis://test", dtype="int8")        # the gateway's --verify-dtype
    assert (await only_int8.route("none")).verify == "i8:1"
    with pytest.raises(RoutingError, match="no verify worker for model 'num' at dtype bfloat16 is registered"):
        await RedisRouter(reg, "num", "redis://test", dtype="bfloat16").route("none")

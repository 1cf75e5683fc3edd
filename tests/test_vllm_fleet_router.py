"""The PDD router in front of a fleet (several instances per role) against stand-in
engines (tests/test_vllm_router.py's ``Engine``): the choice of each instance, the
health check taking instances out and back, the 503 when a role has none up, and the
router's /metrics. Loopback only; every wait is bounded."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pdd_transport import policy, radix
from pdd_transport.integrations.vllm_fleet import EngineSpec, Fleet, NoInstanceError
from pdd_transport.integrations.vllm_router import BackgroundRouter, MainDecodeCacheView, RouterConfig
from test_vllm_router import BLOCK, Engine, assert_error, reference, request, wait_for


class Fleetish:
    """``n_p`` prefills, ``n_md`` MainDecodes, ``n_rld`` RelayDecodes, one router."""

    def __init__(self, n_p: int = 1, n_md: int = 2, n_rld: int = 0, **config: Any) -> None:
        self.ps = [Engine(f"p{i}") for i in range(n_p)]
        self.mds = [Engine(f"md{i}", token_s=0.001) for i in range(n_md)]
        self.rlds = [Engine(f"rld{i}", token_s=0.001) for i in range(n_rld)]
        kw: dict[str, Any] = dict(
            prefills=[e.url for e in self.ps],
            main_decodes=[EngineSpec(e.url, f"10.0.1.{i}:7100") for i, e in enumerate(self.mds)],
            relay_decodes=[(e.url, f"local://127.0.0.1:{7300 + i}") for i, e in enumerate(self.rlds)],
            model="tiny", upstream_timeout_s=20.0, upstream_idle_timeout_s=10.0, main_block_size=BLOCK,
            health_interval_s=0.1, health_timeout_s=1.0)
        kw.update(config)
        self.router = BackgroundRouter(RouterConfig(**kw))
        self.url = self.router.url

    def complete(self, prompt: list[int], max_tokens: int = 4, **extra: Any) -> tuple[int, Any]:
        status, body, _ = request(self.url, "/v1/completions", dict(prompt=prompt, max_tokens=max_tokens, **extra))
        return status, body

    def close(self) -> None:
        self.router.close()
        for e in self.ps + self.mds + self.rlds:
            e.close()


@pytest.fixture
def fleet() -> Iterator[Any]:
    made: list[Fleetish] = []

    def make(**kw: Any) -> Fleetish:
        f = Fleetish(**kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def conversation(seed: int, length: int = 4 * BLOCK) -> list[int]:
    return [(seed * 131 + i * 7) % 400 + 3 for i in range(length)]


def md_of(body: Any) -> str:
    return str(body["choices"][0]["pdd"]["instances"]["main_decode"])


# -- the choice of each instance ------------------------------------------------------


def test_a_later_turn_goes_to_the_md_that_holds_its_prefix(fleet: Any) -> None:
    f = fleet(n_md=2)
    turns: dict[int, list[int]] = {c: conversation(c) for c in range(3)}
    first: dict[int, str] = {}
    for c in range(3):  # first turns: no MD holds anything; ties take turns
        status, body = f.complete(turns[c], 8)
        assert status == 200, body
        first[c] = md_of(body)
        assert body["choices"][0]["pdd"]["md_held_tokens"] == 0
        turns[c] = turns[c] + body["choices"][0]["token_ids"]
    assert sorted(set(first.values())) == ["md0", "md1"]
    for turn in range(2):
        for c in range(3):
            prompt = turns[c] + conversation(100 + 10 * c + turn, BLOCK)
            status, body = f.complete(prompt, 8)
            assert status == 200, body
            choice = body["choices"][0]
            assert md_of(body) == first[c], (c, turn)
            assert choice["pdd"]["md_held_tokens"] >= len(turns[c]) // BLOCK * BLOCK - BLOCK
            assert choice["token_ids"] == reference(prompt, 8)
            turns[c] = prompt + choice["token_ids"]
    # Each MD saw only its own conversations' requests.
    for i, md in enumerate(f.mds):
        assert len(md.requests) == sum(1 for c in range(3) if first[c] == f"md{i}") * 3


def test_round_robin_takes_turns_whatever_is_held(fleet: Any) -> None:
    f = fleet(n_md=2, md_choice="round_robin")
    prompt = conversation(5)
    names = []
    for _ in range(4):
        status, body = f.complete(prompt)
        assert status == 200, body
        names.append(md_of(body))
    assert names == ["md0", "md1", "md0", "md1"]


def _fleet_of_views(n: int, **config: Any) -> tuple[Fleet, list[MainDecodeCacheView]]:
    cfg = RouterConfig(prefills=["http://p0:1", "http://p1:1"],
                       main_decodes=[(f"http://md{i}:1", f"md{i}:7100") for i in range(n)], main_block_size=BLOCK,
                       **config)
    mirror = radix.PrefixMirror(BLOCK)
    views = [MainDecodeCacheView(BLOCK, instance=i, mirror=mirror) for i in range(n)]
    return Fleet(cfg, views), views


def test_md_choice_trades_hit_against_load_by_its_knob() -> None:
    tokens = conversation(9, 10 * BLOCK)
    # md1 holds 8 blocks (128 tokens) of the prompt and has 2 requests in flight: it
    # wins while 128 - 2 * weight > 0.
    for weight, want in ((0, "md1"), (63, "md1"), (65, "md0"), (1000, "md0")):
        fl, views = _fleet_of_views(2, md_load_weight_tokens=weight)
        views[1].record(tokens[: 8 * BLOCK])
        fl.instances["main_decode"][1].in_flight = 2
        choice = fl.pick_main(tokens)
        assert choice.instance.name == want, weight
        assert choice.held_tokens == (8 * BLOCK if want == "md1" else 0)
        assert choice.reason == ("prefix" if want == "md1" else "no_hit")
    # Equal hits: the one with fewer in flight; equal everything: they take turns.
    fl, views = _fleet_of_views(3, md_load_weight_tokens=0)
    for v in views:
        v.record(tokens[: 2 * BLOCK])
    fl.instances["main_decode"][0].in_flight = 1
    assert fl.pick_main(tokens).instance.name in ("md1", "md2")
    fl.instances["main_decode"][0].in_flight = 0
    picks = [fl.pick_main(tokens).instance.name for _ in range(6)]
    assert sorted(picks) == ["md0", "md0", "md1", "md1", "md2", "md2"]


def test_prefill_by_load_and_an_md_that_comes_back_starts_empty() -> None:
    fl, views = _fleet_of_views(2)
    p0, p1 = fl.instances["prefill"]
    p0.in_flight = 3
    assert fl.pick_by_load("prefill") is p1
    p1.in_flight = 5
    assert fl.pick_by_load("prefill") is p0
    p0.in_flight = p1.in_flight = 0
    assert [fl.pick_by_load("prefill").name for _ in range(4)] in (["p0", "p1", "p0", "p1"], ["p1", "p0", "p1", "p0"])
    tokens = conversation(3)
    views[0].record(tokens)
    md0 = fl.instances["main_decode"][0]
    fl.observe(md0, "HTTP 503")
    assert md0.up  # one failure is not enough (health_down_after=2)
    fl.observe(md0, "HTTP 503")
    assert not md0.up and md0.last_error == "HTTP 503"
    assert all(fl.pick_main(tokens).instance.name == "md1" for _ in range(3))
    fl.observe(md0, None)
    assert md0.up and md0.transitions == {"up": 1, "down": 1}
    assert views[0].held_tokens(tokens) == 0  # a restarted MD holds nothing
    fl.observe(md0, "x")
    fl.observe(md0, "x")
    fl.observe(fl.instances["main_decode"][1], "y")
    fl.observe(fl.instances["main_decode"][1], "y")
    with pytest.raises(NoInstanceError, match="no main decode instance is up"):
        fl.pick_main(tokens)


def test_prefill_and_relay_instances_by_load(fleet: Any) -> None:
    f = fleet(n_p=2, n_md=1, n_rld=2, force_pipeline="p_rld")
    for i in range(4):
        status, body = f.complete(conversation(20 + i), 6)
        assert status == 200, body
        assert body["choices"][0]["pdd"]["instances"]["relay_decode"] in ("rld0", "rld1")
    # Sequential requests: every instance idle, so they take turns.
    assert [len(e.requests) for e in f.ps] == [2, 2]
    assert [len(e.requests) for e in f.rlds] == [2, 2]
    assert not f.mds[0].requests


# -- instances leaving and coming back -------------------------------------------------


def test_an_unhealthy_md_is_taken_out_and_put_back(fleet: Any) -> None:
    f = fleet(n_md=2)
    f.mds[1].healthy = False
    router = f.router.router
    md1 = router.fleet.instances["main_decode"][1]
    assert wait_for(lambda: not md1.up, 5.0)
    for i in range(4):
        status, body = f.complete(conversation(40 + i))
        assert status == 200 and md_of(body) == "md0"
    assert not f.mds[1].requests
    status, health, _ = request(f.url, "/health", method="GET")
    assert status == 200 and health["status"] == "degraded"
    assert [i["healthy"] for i in health["instances"]["main_decode"]] == [True, False]
    f.mds[1].healthy = True
    assert wait_for(lambda: md1.up, 5.0)
    names = {md_of(f.complete(conversation(50 + i))[1]) for i in range(4)}
    assert names == {"md0", "md1"}


@pytest.mark.parametrize("pooled", [True, False])
def test_a_dead_md_fails_its_request_clearly_and_gets_no_more(fleet: Any, pooled: bool) -> None:
    # The health check probes once at start (pooled: it leaves a kept-alive connection
    # to each engine) or never, and not again: the failed request itself takes the MD
    # out, whether its connection was pooled (dropped: the MD is probed at once) or new
    # (refused).
    f = fleet(n_md=2, health_interval_s=300.0 if pooled else 0.0, md_choice="round_robin")
    md0 = f.router.router.fleet.instances["main_decode"][0]
    if pooled:
        assert wait_for(lambda: md0.successes == 1, 5.0)
    f.mds[0].close()
    status, body = f.complete(conversation(60))
    assert_error(status, body, 502)
    assert "md" in body["error"]["message"].lower()
    assert not md0.up and md0.last_error
    for i in range(4):
        status, body = f.complete(conversation(61 + i))
        assert status == 200 and md_of(body) == "md1", body


def test_a_dead_prefill_is_taken_out_and_the_others_serve(fleet: Any) -> None:
    f = fleet(n_p=2, n_md=1, health_interval_s=0.1)
    f.ps[0].close()
    p0 = f.router.router.fleet.instances["prefill"][0]
    assert wait_for(lambda: not p0.up, 5.0)
    for i in range(3):
        status, body = f.complete(conversation(70 + i))
        assert status == 200, body
        assert body["choices"][0]["pdd"]["instances"]["prefill"] == "p1"
        assert body["choices"][0]["pdd"]["prefill_error"] is None


def test_no_main_decode_up_is_a_503_error_object(fleet: Any) -> None:
    f = fleet(n_p=2, n_md=2)
    for e in f.mds:
        e.healthy = False
    insts = f.router.router.fleet.instances["main_decode"]
    assert wait_for(lambda: not any(i.up for i in insts), 5.0)
    before = [len(e.requests) for e in f.ps + f.mds]
    for stream in (False, True):
        status, body = f.complete(conversation(80), stream=stream)
        assert_error(status, body, 503)
        assert "no main decode instance is up" in body["error"]["message"]
    assert [len(e.requests) for e in f.ps + f.mds] == before  # nothing reached an engine
    status, health, _ = request(f.url, "/health", method="GET")
    assert_error(status, health, 503)


def test_no_prefill_up_has_md_compute_the_prompt_itself_at_once(fleet: Any) -> None:
    """P down: MD computes the prompt without asking for KV (nobody would send it), so
    no request waits out a grant timeout; the answer says why."""
    f = fleet(n_p=2, n_md=1)
    for e in f.ps:
        e.healthy = False
    insts = f.router.router.fleet.instances["prefill"]
    assert wait_for(lambda: not any(i.up for i in insts), 5.0)
    before = [len(e.requests) for e in f.ps]
    for stream in (False, True):
        prompt = conversation(81 + int(stream))
        status, body = f.complete(prompt, 6, stream=stream)
        assert status == 200, body
        # Streamed: the chunks (the last one the [DONE] marker), their tokens in order.
        choices = [ch for c in body[:-1] for ch in c["choices"]] if stream else body["choices"]
        assert [t for ch in choices for t in ch["token_ids"]] == reference(prompt, 6)
        info = [ch["pdd"] for ch in choices if "pdd" in ch][0]
        assert info["pipeline"] == "p_md" and "prefill" not in info["instances"]
        assert "no prefill instance is up" in info["prefill_error"]
        assert "kv_transfer_params" not in f.mds[0].requests[-1]  # MD was not told to wait
    assert [len(e.requests) for e in f.ps] == before  # nothing reached a prefill instance


def test_with_no_relay_up_requests_take_p_md(fleet: Any) -> None:
    f = fleet(n_md=1, n_rld=1, pipeline_policy=policy.PipelinePolicy(ttft_budget_ms=0.001))
    status, body = f.complete(conversation(90, 8 * BLOCK), 6)
    assert status == 200 and body["choices"][0]["pdd"]["pipeline"] == "p_rld_md", body
    f.rlds[0].healthy = False
    rld = f.router.router.fleet.instances["relay_decode"][0]
    assert wait_for(lambda: not rld.up, 5.0)
    prompt = conversation(91, 8 * BLOCK)
    status, body = f.complete(prompt, 6)
    assert status == 200, body
    info = body["choices"][0]["pdd"]
    assert info["pipeline"] == "p_md" and "no RelayDecode is up" in info["route_reason"]
    assert body["choices"][0]["token_ids"] == reference(prompt, 6)


# -- configuration ---------------------------------------------------------------------


def test_single_instance_fields_and_lists_merge() -> None:
    c = RouterConfig(prefill_url="http://p:1", main_url="http://md:1", main_kv_address="md:7100",
                     main_decodes=[("http://md2:1", "md2:7100")], prefills=["http://p:1"])
    assert [s.url for s in c.prefills] == ["http://p:1"]
    assert [(s.url, s.kv_address) for s in c.main_decodes] == [("http://md:1", "md:7100"), ("http://md2:1", "md2:7100")]
    assert c.main_url == "http://md:1" and c.relay_url is None
    c2 = RouterConfig(prefills=["http://p:1"], main_decodes=[EngineSpec("http://md:1", "md:7100", name="east")])
    assert c2.main_url == "http://md:1" and c2.main_kv_address == "md:7100" and c2.main_decodes[0].name == "east"
    for bad in (dict(prefills=["http://p:1"]),
                dict(prefills=["http://p:1"], main_decodes=["http://md:1"]),
                dict(prefills=["p:1"], main_decodes=[("http://md:1", "md:1")]),
                dict(prefills=["http://p:1"], main_decodes=[("http://md:1", "a:1"), ("http://md:1", "b:1")]),
                dict(prefills=["http://p:1"], main_decodes=[("http://md:1", "a:1")], md_choice="random"),
                dict(prefills=["http://p:1"], main_decodes=[("http://md:1", "a:1")], md_cache_source="events"),
                dict(prefills=["http://p:1"], main_decodes=[("http://md:1", "a:1")], health_down_after=0)):
        with pytest.raises(ValueError):
            RouterConfig(**bad)


# -- the router's /metrics --------------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the router's /metrics, parsed strictly (the text format 0.0.4)."""
    import re
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("#") or not line:
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)', line)
        assert m, line
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        assert any(m.group(1) == t or m.group(1).startswith(t + "_") for t in typed), line
        out[(m.group(1), labels)] = float(m.group(4).replace("+Inf", "inf"))
    return out


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_count_routing_ttft_hits_health_and_errors(fleet: Any) -> None:
    f = fleet(n_md=2, kv_bytes_per_token=100)
    prompt = conversation(200, 4 * BLOCK)
    status, body = f.complete(prompt, 4)
    first = md_of(body)
    prompt2 = prompt + body["choices"][0]["token_ids"] + conversation(201, BLOCK)
    status, body = f.complete(prompt2, 4)
    assert status == 200 and md_of(body) == first
    m = scrape(f.url)
    assert value(m, "pdd_router_requests_total", pipeline="p_md") == 2
    assert value(m, "pdd_router_ttft_seconds_count", pipeline="p_md") == 2
    assert value(m, "pdd_router_ttft_seconds_bucket", pipeline="p_md", le="+Inf") == 2
    assert value(m, "pdd_router_md_choices_total", instance=first, reason="no_hit") == 1
    assert value(m, "pdd_router_md_choices_total", instance=first, reason="prefix") == 1
    held = body["choices"][0]["pdd"]["md_held_tokens"]
    assert held >= 4 * BLOCK - BLOCK
    assert value(m, "pdd_router_md_held_tokens_total") == held
    assert value(m, "pdd_router_md_prompt_tokens_total") == len(prompt) + len(prompt2)
    assert value(m, "pdd_router_md_prefix_hit_ratio") == pytest.approx(held / (len(prompt) + len(prompt2)))
    whole = [(len(p) - 1) // BLOCK * BLOCK for p in (prompt, prompt2)]
    assert value(m, "pdd_router_wan_kv_bytes_estimated_total", instance=first) == (whole[0] + whole[1] - held) * 100
    assert value(m, "pdd_router_instance_up", role="main_decode", instance="md1", url=f.mds[1].url) == 1
    assert value(m, "pdd_router_instance_requests_total", role="prefill", instance="p0") == 2
    # An MD goes down: its gauge and transition; then none up: 503s counted.
    f.mds[1].healthy = False
    md1 = f.router.router.fleet.instances["main_decode"][1]
    assert wait_for(lambda: not md1.up, 5.0)
    f.mds[0].healthy = False
    md0 = f.router.router.fleet.instances["main_decode"][0]
    assert wait_for(lambda: not md0.up, 5.0)
    assert f.complete(prompt)[0] == 503
    m = scrape(f.url)
    assert value(m, "pdd_router_instance_up", role="main_decode", instance="md1", url=f.mds[1].url) == 0
    assert value(m, "pdd_router_instance_transitions_total", role="main_decode", instance="md1", to="down") == 1
    assert value(m, "pdd_router_errors_total", code="503") == 1


def test_metric_families_render_the_text_format() -> None:
    from pdd_transport.integrations.vllm_router_metrics import Family

    c = Family("x_total", "counter", 'a "help"\nline', ("who",))
    c.inc(who='a"b\\c\nd')
    c.inc(2, who="z")
    with pytest.raises(ValueError):
        c.inc(-1, who="z")
    with pytest.raises(ValueError):
        c.inc(who="z", extra="1")
    assert c.render() == ['# HELP x_total a "help"\\nline', "# TYPE x_total counter",
                          'x_total{who="a\\"b\\\\c\\nd"} 1', 'x_total{who="z"} 2']
    h = Family("t_seconds", "histogram", "t", ("p",), buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.observe(v, p="x")
    assert h.render()[2:] == ['t_seconds_bucket{p="x",le="0.1"} 1', 't_seconds_bucket{p="x",le="1"} 2',
                              't_seconds_bucket{p="x",le="+Inf"} 3', 't_seconds_sum{p="x"} 5.55',
                              't_seconds_count{p="x"} 3']


def test_metrics_parse_with_prometheus_clients_own_parser(fleet: Any) -> None:
    # The test extra has prometheus_client (the router itself does not need it).
    parser = pytest.importorskip("prometheus_client.parser")
    import urllib.request

    f = fleet(n_md=2)
    assert f.complete(conversation(300))[0] == 200
    with urllib.request.urlopen(f.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    families = {fam.name: fam for fam in parser.text_string_to_metric_families(text)}
    assert families["pdd_router_ttft_seconds"].type == "histogram"
    assert families["pdd_router_requests"].type == "counter"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in families.values() for s in fam.samples}
    assert samples[("pdd_router_requests_total", (("pipeline", "p_md"),))] == 1
    assert samples[("pdd_router_ttft_seconds_count", (("pipeline", "p_md"),))] == 1
    ups = [v for (name, labels), v in samples.items() if name == "pdd_router_instance_up"]
    assert sorted(ups) == [1.0, 1.0, 1.0]

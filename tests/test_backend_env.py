"""Backend environment: action parsing, reward normalization, retriever, world, rollout masks."""

from __future__ import annotations

import json

import pytest

from lld_monitor.backend.config import EnvConfig
from lld_monitor.backend.env import INVALID_MESSAGE, parse_action, rollout
from lld_monitor.backend.retriever import BM25Retriever, HTTPRetriever, load_jsonl_corpus
from lld_monitor.backend.reward import em_reward, extract_answer, normalize_answer
from lld_monitor.backend.world import Document, WorldConfig, build_world
from lld_monitor.roles import ROLE_ACTION, ROLE_TOOL


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize(
    "text,kind,content",
    [
        ("<search> anna kovar </search>", "search", "anna kovar"),
        ("<answer> velor </answer>", "answer", "velor"),  # answer without any search is a valid action
        ("think first <search> x y </search> trailing", "search", "x y"),
        ("<search> anna kovar", "invalid", ""),  # missing </search>
        ("<search> anna </answer>", "invalid", ""),  # mismatched tags
        ("<serch> anna </serch>", "invalid", ""),  # malformed tag
        ("< search > anna < /search >", "invalid", ""),
        ("<search>  </search>", "invalid", ""),  # empty query
        ("", "invalid", ""),
        ("anna kovar velor " * 20, "invalid", ""),  # overlong output without any tag
        ("<answer> a </answer> <search> b </search>", "answer", "a"),  # first closed span wins
    ],
)
def test_parse_action(text, kind, content):
    act = parse_action(text)
    assert act.kind == kind
    if kind != "invalid":
        assert act.content == content


# ------------------------------------------------------------------ reward
def test_normalize_answer():
    assert normalize_answer("  The Velor! ") == "velor"
    assert normalize_answer("an Apple, a day") == "apple day"
    assert normalize_answer("New   York.") == "new york"
    assert normalize_answer("") == ""


def test_em_reward_uses_last_answer_and_normalization():
    assert em_reward("<answer> The Velor. </answer>", ["velor"]) == 1.0
    assert em_reward("<answer> zandia </answer> ... <answer> velor </answer>", ["velor"]) == 1.0
    assert em_reward("<answer> velor </answer> <answer> zandia </answer>", ["velor"]) == 0.0
    assert em_reward("<answer> velor", ["velor"]) == 0.0  # not closed
    assert em_reward("velor", ["velor"]) == 0.0  # no answer tags
    assert em_reward("<answer> velo </answer>", ["velor", "velo"]) == 1.0  # any gold
    assert extract_answer("<search> q </search>") is None


# ------------------------------------------------------------------ retriever
DOCS = [
    Document("p1", "anna kovar", "anna kovar was born in velor ."),
    Document("c1", "velor", "velor is a city in zandia ."),
    Document("k1", "zandia", "zandia is a country . its capital is velor ."),
    Document("p2", "anna brask", "anna brask was born in tilos ."),
]


def test_bm25_finds_known_documents():
    r = BM25Retriever(DOCS)
    hits = r.search(["anna kovar", "zandia capital", "tilos", "nothing matches this"], k=2)
    assert hits[0][0].doc_id == "p1"
    assert {h.doc_id for h in hits[0]} == {"p1", "p2"}  # 'anna' also matches the other anna
    assert hits[1][0].doc_id == "k1"
    assert [h.doc_id for h in hits[2]] == ["p2"]
    assert hits[3] == []
    assert hits[0][0].score >= hits[0][1].score


def test_bm25_on_generated_world_retrieves_the_entity_document():
    w = build_world(WorldConfig(n_people=200, n_orgs=40, n_cities=40, n_countries=10, n_first_names=20, n_last_names=20))
    r = BM25Retriever(w.documents)
    qs = w.questions[:50]
    hits = r.search([q.chain[0][0] for q in qs], k=3)
    top1 = sum(h[0].title == q.chain[0][0] for h, q in zip(hits, qs) if h)
    assert top1 >= 45  # the entity's own document ranks first for (nearly) every first hop


def test_jsonl_corpus(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(
        json.dumps({"id": "a", "contents": '"Velor"\nvelor is a city in zandia .'}) + "\n\n"
        + json.dumps({"text": "anna kovar was born in velor .", "title": "anna kovar"}) + "\n"
    )
    docs = load_jsonl_corpus(p)
    assert [d.doc_id for d in docs] == ["a", "2"]
    assert docs[0].title == "Velor" and docs[0].text.startswith("velor is")
    assert BM25Retriever(docs).search(["anna"], 1)[0][0].title == "anna kovar"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl_corpus(bad)
    with pytest.raises(FileNotFoundError):
        load_jsonl_corpus(tmp_path / "missing.jsonl")


def test_http_retriever_against_a_local_server():
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            res = [[{"document": {"id": "d1", "contents": f'"T"\nabout {q}'}, "score": 1.5}][: body["topk"]] for q in body["queries"]]
            out = json.dumps({"result": res}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        r = HTTPRetriever(f"http://127.0.0.1:{srv.server_port}/retrieve")
        hits = r.search(["velor", "zandia"], 3)
        assert [h[0].text for h in hits] == ["about velor", "about zandia"]
        assert hits[0][0].title == "T" and hits[0][0].score == 1.5
    finally:
        srv.shutdown()
    with pytest.raises(RuntimeError, match="is the server running"):
        HTTPRetriever("http://127.0.0.1:9/retrieve", timeout_s=1).search(["x"], 1)


# ------------------------------------------------------------------ world
def test_world_is_deterministic_and_two_hop_needs_the_first_answer():
    cfg = WorldConfig(n_people=200, n_orgs=40, n_cities=40, n_countries=10, n_first_names=20, n_last_names=20)
    a, b = build_world(cfg), build_world(cfg)
    assert [d.text for d in a.documents] == [d.text for d in b.documents]
    assert [q.question for q in a.questions] == [q.question for q in b.questions]
    two = a.two_hop
    assert two and a.single_hop
    text = {d.title: d.text for d in a.documents}
    for q in two[:20]:
        (q1, a1), (q2, a2) = q.chain
        assert a1 in text[q1]  # first hop's document names the bridge entity
        assert q2 == a1 and a2 == q.answers[0] and a2 in text[q2]


def test_unique_names_give_every_person_name_parts_of_their_own():
    cfg = WorldConfig(n_people=120, n_orgs=20, n_cities=24, n_countries=8, unique_names=True)
    w = build_world(cfg)
    people = [d.title for d in w.documents if d.doc_id.startswith("person:")]
    assert len(people) == 120
    firsts, lasts = [p.split()[0] for p in people], [p.split()[1] for p in people]
    assert len(set(firsts)) == len(set(lasts)) == 120 and not set(firsts) & set(lasts)
    assert [q.question for q in build_world(cfg).questions] == [q.question for q in w.questions]
    # the default pairs random first and last names, so a name part is shared by several people
    shared = build_world(WorldConfig(n_people=120, n_orgs=20, n_cities=24, n_countries=8, n_first_names=20, n_last_names=20))
    assert len({d.title.split()[0] for d in shared.documents if d.doc_id.startswith("person:")}) <= 20
    with pytest.raises(ValueError, match="n_people exceeds"):
        build_world(WorldConfig(n_people=500, n_first_names=20, n_last_names=20))
    build_world(WorldConfig(n_people=500, n_first_names=20, n_last_names=20, n_orgs=20, n_cities=24, n_countries=8,
                            unique_names=True))  # the name counts do not apply


# ------------------------------------------------------------------ rollout with a scripted policy
class _ScriptedLM:
    """A stand-in *policy* (not a mock of the environment): emits a fixed token script per row, so
    the real environment's parsing, retrieval and masking can be checked exactly."""

    def __init__(self, tok, scripts):
        import torch

        self.tok = tok
        self.scripts = [list(s) for s in scripts]
        self.calls = 0
        self._p = torch.nn.Parameter(torch.zeros(1))
        self.training = False

    def parameters(self):
        yield self._p

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def __call__(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True):
        import torch

        n = input_ids.shape[0]
        v = len(self.tok)
        logits = torch.full((n, input_ids.shape[1], v), -1e9)
        # the model only controls action tokens; the env decides when a row is generating.
        # we pop the next scripted token for every row that will be asked.
        for i in range(n):
            nxt = self.scripts[i][0] if self.scripts[i] else self.tok.pad_token_id
            logits[i, :, nxt] = 0.0  # at every position: a call may end a row's tokens before its last column

        class Out:
            pass

        o = Out()
        o.logits = logits
        o.cache = None
        self.last_pred = logits
        return o


def test_rollout_masks_observations_and_handles_invalid_actions():
    import torch

    from lld_monitor.backend.tokenizer import build_tokenizer

    tok = build_tokenizer([d.text for d in DOCS] + ["where was anna kovar born ?"])
    cfg = EnvConfig(max_turns=2, max_action_tokens=4, topk=1)
    r = BM25Retriever(DOCS)

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    scripts = [
        ids("<search> anna kovar </search> <answer> velor </answer>"),  # search then answer
        ids("<answer> velor </answer>"),  # answer without search
        ids("<search> anna kovar velor <answer> velor </answer>"),  # missing </search> -> overlong -> invalid
    ]

    class AdvancingPolicy(_ScriptedLM):
        def __call__(self, input_ids, attention_mask=None, **kw):
            # after the prompt, a call feeds each row its sampled token (then, for some rows, what the
            # environment appended); the row's first real new token is the script head it sampled: advance
            n = input_ids.shape[1]
            if attention_mask is not None and attention_mask.shape[1] > n:
                for i in range(input_ids.shape[0]):
                    real = input_ids[i][attention_mask[i, -n:].bool()]
                    if len(real) and self.scripts[i] and int(real[0]) == self.scripts[i][0]:
                        self.scripts[i].pop(0)
            return super().__call__(input_ids, attention_mask=attention_mask, **kw)

    pol = AdvancingPolicy(tok, scripts)
    ro = rollout(pol, tok, ["where was anna kovar born ?"] * 3, r, cfg, torch.Generator().manual_seed(0))
    assert ro.finished == [True, True, True]
    assert ro.n_searches == [1, 0, 0]
    t0 = ro.response_texts[0]
    assert "<information> doc 1 : anna kovar was born in velor . </information>" in t0
    assert em_reward(t0, ["velor"]) == 1.0
    assert em_reward(ro.response_texts[1], ["velor"]) == 1.0
    assert INVALID_MESSAGE in ro.response_texts[2]
    assert ro.n_actions[2] == 2 and ro.n_valid_actions[2] == 1
    # every token of <information>...</information> and of the invalid message is a tool token
    for i in range(3):
        toks = tok.convert_ids_to_tokens(ro.response_ids[i][ro.response_mask[i]].tolist())
        roles = ro.role[i][ro.response_mask[i]].tolist()
        inside = False
        for t, rl in zip(toks, roles):
            if t == "<information>":
                inside = True
            if inside:
                assert rl == ROLE_TOOL, (t, rl)
            if t == "</information>":
                inside = False
        assert roles.count(ROLE_ACTION) > 0

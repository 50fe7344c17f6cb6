"""A generated, seeded knowledge base and the questions that need it.

The world has countries, cities, organisations and people. Every entity gets one short document
(all lower-case, words separated by spaces, so a word-level tokenizer covers it exactly). Questions
are single-hop (one search answers them) or two-hop (the second search needs the first answer,
e.g. "in which country was anna kovar born ?" -> search the person -> their city -> search the city
-> its country). The first search of a two-hop question is shared with a single-hop question about
the same entity, which is what makes correct first actions appear inside wrong responses.

Everything is a pure function of `WorldConfig` (seeded `random.Random`), so two processes that build
the same config get the same documents, questions and ids.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr", "vl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
_CODAS = ["", "", "n", "r", "s", "l", "x", "th", "nd", "m"]

PROFESSIONS = ["painter", "doctor", "engineer", "teacher", "farmer", "writer", "pilot", "lawyer", "chef", "singer"]
INDUSTRIES = ["software", "shipping", "mining", "textile", "banking", "energy", "media", "farming"]

# words that appear in templates; generated names must not collide with them
TEMPLATE_WORDS = set(
    """
    is a the was born in and works for as city country its capital company based founded located
    where what which who of question information answer search doc invalid action use or no results
    employer profession industry does work headquarters lives
    """.split()
) | set(PROFESSIONS) | set(INDUSTRIES)


@dataclass(frozen=True)
class WorldConfig:
    seed: int = 0
    n_countries: int = 30
    n_cities: int = 150
    n_orgs: int = 200
    n_first_names: int = 50
    n_last_names: int = 50
    n_people: int = 2000
    two_hop_frac: float = 0.5  # fraction of questions that need two searches
    # True: every person has a first and a last name no one else has (n_people of each are made and
    # n_first_names / n_last_names are not used). False: people are random (first, last) pairs, so a
    # name part is shared by about n_people / n_first_names people and copying a name means telling
    # them apart.
    unique_names: bool = False
    # True: a person's name is one word, "first_last", so one token of the word-level vocabulary: copying it
    # into a search is one copy, not a first name followed by a last name the model may complete from memory
    single_token_names: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class Question:
    qid: str
    question: str
    answers: tuple[str, ...]
    hops: int  # 1 or 2
    kind: str  # template name
    # the query and the answer of each hop, used by the demonstrations (and only by them)
    chain: tuple[tuple[str, str], ...] = field(default_factory=tuple)


@dataclass
class World:
    config: WorldConfig
    documents: list[Document]
    questions: list[Question]

    @property
    def single_hop(self) -> list[Question]:
        return [q for q in self.questions if q.hops == 1]

    @property
    def two_hop(self) -> list[Question]:
        return [q for q in self.questions if q.hops == 2]

    def texts(self) -> list[str]:
        """All text the model can see: documents and questions (for building the vocabulary)."""
        return [d.text for d in self.documents] + [q.question for q in self.questions]


def _name_generator(rng: random.Random, used: set[str]):
    def make(min_syl: int = 2, max_syl: int = 3) -> str:
        for _ in range(10_000):
            n = rng.randint(min_syl, max_syl)
            w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n)) + rng.choice(_CODAS)
            if w not in used and w not in TEMPLATE_WORDS and len(w) >= 4:
                used.add(w)
                return w
        raise RuntimeError("name space exhausted; lower the world sizes")

    return make


def build_world(config: WorldConfig | None = None) -> World:
    """Generate the documents and questions of a world (deterministic in `config`)."""
    cfg = config or WorldConfig()
    if not cfg.unique_names and cfg.n_people > cfg.n_first_names * cfg.n_last_names:
        raise ValueError("n_people exceeds n_first_names * n_last_names; raise the name counts")
    if min(cfg.n_countries, cfg.n_cities, cfg.n_orgs, cfg.n_people) < 1:
        raise ValueError("every entity count in WorldConfig must be >= 1")
    if cfg.n_cities < cfg.n_countries:
        raise ValueError("n_cities must be >= n_countries (every country needs a capital)")
    rng = random.Random(cfg.seed)
    used: set[str] = set()
    name = _name_generator(rng, used)

    countries = [name(2, 3) for _ in range(cfg.n_countries)]
    cities = [name(2, 2) for _ in range(cfg.n_cities)]
    orgs = [name(2, 3) for _ in range(cfg.n_orgs)]
    if cfg.unique_names:
        firsts = [name(2, 2) for _ in range(cfg.n_people)]
        lasts = [name(2, 3) for _ in range(cfg.n_people)]
    else:
        firsts = [name(2, 2) for _ in range(cfg.n_first_names)]
        lasts = [name(2, 3) for _ in range(cfg.n_last_names)]

    # every country gets one capital among its cities; the rest are spread at random
    city_country = {}
    for i, c in enumerate(cities):
        city_country[c] = countries[i] if i < len(countries) else rng.choice(countries)
    capital = {countries[i]: cities[i] for i in range(len(countries))}
    org_city = {o: rng.choice(cities) for o in orgs}
    org_industry = {o: rng.choice(INDUSTRIES) for o in orgs}
    sep = "_" if cfg.single_token_names else " "
    if cfg.unique_names:
        people = [f"{f}{sep}{l}" for f, l in zip(firsts, lasts)]
    else:
        pairs = [(f, l) for f in firsts for l in lasts]
        rng.shuffle(pairs)
        people = [f"{f}{sep}{l}" for f, l in pairs[: cfg.n_people]]
    person_city = {p: rng.choice(cities) for p in people}
    person_org = {p: rng.choice(orgs) for p in people}
    person_prof = {p: rng.choice(PROFESSIONS) for p in people}

    docs: list[Document] = []
    for k in countries:
        docs.append(Document(f"country:{k}", k, f"{k} is a country . its capital is {capital[k]} ."))
    for c in cities:
        docs.append(Document(f"city:{c}", c, f"{c} is a city in {city_country[c]} ."))
    for o in orgs:
        docs.append(Document(f"org:{o}", o, f"{o} is a {org_industry[o]} company based in {org_city[o]} ."))
    for p in people:
        docs.append(
            Document(
                f"person:{p.replace(' ', '_')}",
                p,
                f"{p} is a {person_prof[p]} . {p} was born in {person_city[p]} and works for {person_org[p]} .",
            )
        )

    qs: list[Question] = []

    def add(kind: str, text: str, answer: str, chain: tuple[tuple[str, str], ...]) -> None:
        qs.append(Question(f"q{len(qs):05d}", text, (answer,), len(chain), kind, chain))

    # single-hop questions (one per entity-attribute) ...
    single: list[tuple[str, str, str, tuple]] = []
    for p in people:
        single.append(("born_city", f"where was {p} born ?", person_city[p], ((p, person_city[p]),)))
        single.append(("employer", f"who does {p} work for ?", person_org[p], ((p, person_org[p]),)))
    for c in cities:
        single.append(("city_country", f"in which country is {c} ?", city_country[c], ((c, city_country[c]),)))
    for k in countries:
        single.append(("capital", f"what is the capital of {k} ?", capital[k], ((k, capital[k]),)))
    for o in orgs:
        single.append(("org_city", f"where is {o} based ?", org_city[o], ((o, org_city[o]),)))
    # ... and two-hop questions whose first search is the same as a single-hop one's
    double: list[tuple[str, str, str, tuple]] = []
    for p in people:
        c = person_city[p]
        double.append(("born_country", f"in which country was {p} born ?", city_country[c], ((p, c), (c, city_country[c]))))
        o = person_org[p]
        double.append(("employer_city", f"where is the employer of {p} based ?", org_city[o], ((p, o), (o, org_city[o]))))
    for o in orgs:
        c = org_city[o]
        double.append(("org_country", f"in which country is {o} based ?", city_country[c], ((o, c), (c, city_country[c]))))

    rng.shuffle(single)
    rng.shuffle(double)
    # mix to the requested two-hop fraction, using as many questions as the smaller pool allows
    n_two = len(double)
    n_one = len(single)
    f = cfg.two_hop_frac
    if 0.0 < f < 1.0:
        total = min(n_one / (1 - f), n_two / f)
        n_two, n_one = int(total * f), int(total * (1 - f))
    elif f >= 1.0:
        n_one = 0
    else:
        n_two = 0
    mixed = single[:n_one] + double[:n_two]
    rng.shuffle(mixed)
    for kind, text, ans, chain in mixed:
        add(kind, text, ans, chain)
    return World(cfg, docs, qs)

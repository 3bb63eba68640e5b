"""Med-R3's judge-based rewards (the Med-R3 paper, "Progressive Reinforcement Learning" and appendix
"Reward Modeling Details"): answer correctness, the reasoning process (semantic + statistic + logical), the retrieval
number, and retrieval effectiveness (quality + breadth). Every component is normalised to [0, 1].

The LLM work goes to one `actors.judge.JudgeActor`, found by its Ray name (arg `judge`, default "JudgeActor"), so every
reward actor shares it. A reward sends all prompts of a batch in one call (identical prompts once); judgements of
fixed texts (reference reasonings, retrieved documents) are cached per reward instance. An output the judge cannot
parse after its retries scores 0 for that sample and is counted in `JudgeActor.stats()["parse_failures"]`.

Where the references come from in a task record (`tasks.schema.Task`):
- `answer`, `options`, `references`: the gold answer (the gold option's text for multiple choice) and its accepted
  variants, shown to the judge for `judge_answer`;
- `metadata["reference_reasonings"]`: list of reference reasoning texts (the paper's N reasoning processes per
  question written by a frontier model), needed by `med_r3_reasoning`;
- `metadata["reference_triples"]` (optional): one knowledge graph per reference, each a list of [head, relation, tail]
  (a 4th item, the source flag, is ignored). Without it, the graphs are extracted from the reference reasonings by
  the judge with the same prompt as the model's reasoning (the paper extracts both with DeepSeek-V3) and cached.
A task without `reference_reasonings` makes `med_r3_reasoning` raise a ValueError naming the task: the reward actor's
`rewards.on_error` then fails the step or scores the component 0 for the batch with a warning and an error count.
The HPO diagnosis tasks (`tasks/hpo_tasks.py`) carry both, written from the ontology.

Prompt templates are reward args (str.format templates; the fields each needs are checked when the reward is built).
"""
from __future__ import annotations

import re
import string
from typing import Any

import ray

from actors.trajectory import Trajectory
from rewards.builtin import extract_answer
from rewards.query_semantic import gold_answer_text, queries, retrieved_texts
from rewards.registry import register_reward

Triple = tuple[str, str, str]

ANSWER_PROMPT = """You grade the answer to a medical question against the reference answer.

Question:
{question}

Reference answer: {reference}

Answer to grade: {answer}

Score 2 if the answer is completely correct (same meaning as the reference; synonyms and paraphrases count), 1 if it \
is partially correct (for example several answers of which at least one matches the reference), 0 if it is incorrect.
Reply with the score alone on the last line."""

TRIPLES_PROMPT = """Extract the medical knowledge graph of this reasoning process as triples \
[head, relation, tail, source]. Heads and tails are entities (diseases, symptoms, findings, tests, treatments) as \
short noun phrases; relations are short verb phrases; source is 1 if the fact comes from a retrieved document (text \
the search returned, such as <document>...</document>), else 0.

Reasoning process:
{reasoning}

Reply with a JSON list only, for example [["oliguria", "suggests", "dehydration", 0]]."""

EVIDENCE_PROMPT = """Grade the level of evidence of this medical document by the hierarchy of Evidence-Based Medicine:
1 systematic review or meta-analysis; 2 randomised controlled trial; 3 cohort study; 4 case-control study; \
5 case series or case report; 6 background information or expert opinion.

Document:
{document}

Reply with the level (1-6) alone on the last line."""

ANSWER_SCORES = [0, 1, 2]
EVIDENCE_LEVELS = [1, 2, 3, 4, 5, 6]


# ---- the formulas -----------------------------------------------------------------------------------------------
def jaccard(a: set, b: set) -> float:
    """Jaccard(A, B) = |A ∩ B| / |A ∪ B| (Med-R3 eq. 13); 0 when both are empty (nothing to agree on)."""
    union = a | b
    return len(a & b) / len(union) if union else 0.0


def answer_score(score: int | None) -> float:
    """R_answer in {2, 1, 0} (eq. 3: fully / partially / not correct) normalised to [0, 1]: score / 2; an
    unparsed judgement (None) is 0."""
    return 0.0 if score is None else score / 2


def semantic_score(cosines: list[float]) -> float:
    """R_semantic = max_i cos(phi(r_ref^i), phi(r_gen)) (eq. 5), normalised to [0, 1] by clipping at 0 (a negative
    cosine, opposite meaning, earns nothing); 0 without references."""
    return max(0.0, min(1.0, max(cosines))) if cosines else 0.0


def normalise_triples(triples: list) -> list[Triple]:
    """Lower-cased, whitespace-collapsed (head, relation, tail): "Acute  Kidney Injury" meets "acute kidney injury"."""
    return [tuple(" ".join(str(x).lower().split()) for x in t[:3]) for t in triples]


def statistic_score(generated: list[Triple], references: list[list[Triple]]) -> float:
    """R_statistic = max_i [ J(E_ref^i, E_gen) + J(L_ref^i, L_gen) ] (eq. 6: key-entity coverage + relation
    coverage, E the heads and tails, L the relations), normalised to [0, 1] by halving; 0 without references."""
    def entities(g):
        return {x for h, _, t in g for x in (h, t)}

    def relations(g):
        return {r for _, r, _ in g}
    return max(((jaccard(entities(ref), entities(generated)) + jaccard(relations(ref), relations(generated))) / 2
                for ref in references), default=0.0)


def hop_paths(triples: list[Triple], hops: int) -> set[tuple[Triple, ...]]:
    """Every directed path of exactly `hops` triples (tail of one = head of the next) that visits no entity twice."""
    out: dict[str, list[Triple]] = {}
    for t in dict.fromkeys(triples):
        out.setdefault(t[0], []).append(t)
    paths = {(t,) for t in dict.fromkeys(triples) if t[0] != t[2]}
    for _ in range(hops - 1):
        paths = {p + (t,) for p in paths for t in out.get(p[-1][2], ())
                 if t[2] not in {p[0][0], *(q[2] for q in p)}}
    return paths


def longest_path(triples: list[Triple], cap: int) -> int:
    """The number of triples on the longest simple path, counted up to `cap`."""
    hops = 0
    while hops < cap and hop_paths(triples, hops + 1):
        hops += 1
    return hops


def hop_weights(k: int) -> list[float]:
    """Weights of the j-hop Jaccards in eq. 7: j * 2 / (K (K + 1)) for j = 1..K; they sum to 1."""
    return [2 * j / (k * (k + 1)) for j in range(1, k + 1)]


def logical_score(generated: list[Triple], references: list[list[Triple]], max_hops: int = 4,
                  max_triples: int = 64) -> float:
    """R_logical = max_i 2/(K(K+1)) sum_{j=1..K} j * J(P_ref^(i,j), P_gen^j) (eq. 7, Algorithm 1), P^j the j-hop
    paths of a graph, K = min(longest path of the generated graph, longest path over the references), capped at
    `max_hops`. In [0, 1]; 0 if either side has no path. Path sets grow quickly with j and with dense graphs, so
    only the first `max_triples` triples of each graph form paths."""
    generated, references = generated[:max_triples], [r[:max_triples] for r in references]
    k = min(longest_path(generated, max_hops), max((longest_path(r, max_hops) for r in references), default=0))
    if k == 0:
        return 0.0
    weights = hop_weights(k)
    gen = [hop_paths(generated, j) for j in range(1, k + 1)]
    return max(sum(w * jaccard(hop_paths(ref, j), g) for j, (w, g) in enumerate(zip(weights, gen), start=1))
               for ref in references)


def retrieval_num_score(searches: int, delta: int = 3) -> float:
    """R_retrieval_num = 1 if the number of searches n >= delta else 0 (eq. 8; delta = 3)."""
    return float(searches >= delta)


def quality_score(levels: list[int | None]) -> float:
    """R_quality = (1/D) sum_j (6 - (e_j - 1)) over the D retrieved documents (eq. 10), evidence level e in 1..6
    (1 strongest), each term normalised to [0, 1] as (6 - (e - 1) - 1) / 5 = (6 - e) / 5. A document whose level
    did not parse counts 0; no documents: 0."""
    return sum(0.0 if e is None else (6 - e) / 5 for e in levels) / len(levels) if levels else 0.0


def breadth_score(sources: list[int]) -> float:
    """R_breadth = (1/|G|) sum_j 1(s_j = 1) (eq. 11): the share of the reasoning's triples whose source flag says
    they came from retrieved documents; 0 for an empty graph."""
    return sum(s == 1 for s in sources) / len(sources) if sources else 0.0


# ---- trajectory fields -------------------------------------------------------------------------------------------
def reasoning_text(text: str, answer_tag: str = "answer") -> str:
    """The response before its last <answer> (all of it without one): the policy's reasoning with the documents it
    retrieved, which is what Med-R3 turns into a knowledge graph."""
    cut = text.rfind(f"<{answer_tag}>")
    return (text if cut < 0 else text[:cut]).strip()


def plain_text(text: str) -> str:
    """Text without grammar tags (<think>, </document>, ...), whitespace collapsed: what a sentence encoder compares."""
    return " ".join(re.sub(r"</?[A-Za-z_]+>", " ", text).split())


def question_text(task: dict) -> str:
    """The last user message of the task's prompt."""
    users = [m["content"] for m in task.get("messages", []) if m["role"] == "user"]
    return users[-1] if users else ""


def reference_answer_text(task: dict) -> str:
    """The gold answer as text, with the accepted variants (task references) after it."""
    gold = gold_answer_text(task)
    others = [r for r in task.get("references", []) if r.strip() and r != gold]
    return gold + (f" (also acceptable: {'; '.join(others)})" if others else "")


def reference_reasonings(task: dict) -> list[str]:
    """metadata["reference_reasonings"]; a ValueError naming the task if it is missing or not non-empty strings."""
    refs = (task.get("metadata") or {}).get("reference_reasonings")
    if not (isinstance(refs, list) and refs and all(isinstance(r, str) and r.strip() for r in refs)):
        raise ValueError(f"task {task.get('id')!r}: metadata.reference_reasonings must be a non-empty list of "
                         f"reasoning texts (Med-R3's reference reasoning processes), got {refs!r}")
    return refs


def reference_graphs(task: dict) -> list[list[Triple]] | None:
    """metadata["reference_triples"] as normalised graphs, None if the task has none; malformed: a ValueError."""
    graphs = (task.get("metadata") or {}).get("reference_triples")
    if graphs is None:
        return None
    ok = isinstance(graphs, list) and all(
        isinstance(g, list) and all(isinstance(t, list) and len(t) in (3, 4)
                                    and all(isinstance(x, str) for x in t[:3]) for t in g) for g in graphs)
    if not ok:
        raise ValueError(f"task {task.get('id')!r}: metadata.reference_triples must be a list of graphs, each a list "
                         f"of [head, relation, tail] string triples")
    return [normalise_triples(g) for g in graphs]


# ---- the judge, from a reward's side ----------------------------------------------------------------------------
def check_template(template: str, fields: set[str], arg: str) -> str:
    """A str.format template that names exactly `fields`; else a ValueError naming the reward arg."""
    found = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    if found != fields:
        raise ValueError(f"reward arg {arg!r}: the template must use the fields {sorted(fields)} (literal braces "
                         f"doubled), it uses {sorted(found)}")
    return template


class JudgeClient:
    """Sends a reward's prompts to the named JudgeActor: one call per batch, identical prompts once, and (for texts
    that never change, such as documents) a bounded cache of parsed judgements."""

    def __init__(self, name: str, system: str | None = None, cache_size: int = 50_000):
        self.name, self.system, self.cache_size = name, system, cache_size
        self.cache: dict[str, Any] = {}
        self._actor = None

    @property
    def actor(self):
        if self._actor is None:  # looked up at first use: the judge may start after the reward actor
            try:
                self._actor = ray.get_actor(self.name)
            except ValueError as e:
                raise RuntimeError(f"reward arg 'judge': no Ray actor named {self.name!r} is running (start a "
                                   f"JudgeActor with that name, config key `judge`)") from e
        return self._actor

    def messages(self, content: str) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": content}]

    def ask(self, contents: list[str], parser: str, cached: bool = False, **parser_args) -> tuple:
        """Send the prompts not answered yet (those in the cache, if `cached`, are not); returns what `result` needs,
        so several calls can be in flight before any is waited on."""
        unique = [c for c in dict.fromkeys(contents) if not (cached and c in self.cache)]
        ref = self.actor.judge.remote([self.messages(c) for c in unique], parser, **parser_args) if unique else None
        return contents, unique, ref, cached

    def result(self, pending: tuple) -> list[Any]:
        """One parsed judgement (None: unparsable) per content of the `ask` that returned `pending`."""
        contents, unique, ref, cached = pending
        got = dict(zip(unique, ray.get(ref))) if ref is not None else {}
        out = [got[c] if c in got else self.cache[c] for c in contents]
        for c, v in got.items() if cached else ():
            if v is not None:  # an unparsed one is asked again next time
                if len(self.cache) >= self.cache_size:
                    self.cache.pop(next(iter(self.cache)))
                self.cache[c] = v
        return out


# ---- the rewards -------------------------------------------------------------------------------------------------
@register_reward("judge_answer")
class JudgeAnswer:
    """R_answer (eq. 3): the judge scores the <answer> 2/1/0 against the reference answer, normalised to [0, 1].
    No <answer>: 0 without asking."""

    def __init__(self, judge: str = "JudgeActor", prompt: str = ANSWER_PROMPT, system: str | None = None):
        self.prompt = check_template(prompt, {"question", "reference", "answer"}, "prompt")
        self.judge = JudgeClient(judge, system)

    def __call__(self, trajectories: list[Trajectory]) -> dict[str, list[float]]:
        answers = [extract_answer(t.text) for t in trajectories]
        asked = [i for i, a in enumerate(answers) if a]
        contents = [self.prompt.format(question=question_text(trajectories[i].task), answer=answers[i],
                                       reference=reference_answer_text(trajectories[i].task)) for i in asked]
        scores = [0.0] * len(trajectories)
        for i, s in zip(asked, self.judge.result(self.judge.ask(contents, "score", allowed=ANSWER_SCORES))):
            scores[i] = answer_score(s)
        return {"judge_answer": scores}


@register_reward("med_r3_reasoning")
class MedR3Reasoning:
    """R_reasoning = R_semantic + R_statistic + R_logical (eq. 4), returned as three components each in [0, 1].

    Semantic: the sentence encoder of `rewards.semantic` (`encoder_dir`, None: MiniLM; the paper uses BGE) on the
    texts without grammar tags. Statistic and logical: the judge extracts the reasoning's knowledge graph (`prompt`,
    parsed as [head, relation, tail, source] triples); an unparsable graph scores 0 on both, and a reference whose
    graph does not parse is left out. An empty reasoning scores 0 on all three. References: see the module
    docstring.
    """

    def __init__(self, judge: str = "JudgeActor", prompt: str = TRIPLES_PROMPT, system: str | None = None,
                 encoder_dir: str | None = None, max_hops: int = 4, answer_tag: str = "answer"):
        from rewards.semantic import load_encoder
        self.prompt = check_template(prompt, {"reasoning"}, "prompt")
        self.judge = JudgeClient(judge, system)
        self.encoder = load_encoder(encoder_dir)
        self.max_hops, self.answer_tag = max_hops, answer_tag

    def __call__(self, trajectories: list[Trajectory]) -> dict[str, list[float]]:
        n = len(trajectories)
        refs = [reference_reasonings(t.task) for t in trajectories]
        given = [reference_graphs(t.task) for t in trajectories]
        reasonings = [reasoning_text(t.text, self.answer_tag) for t in trajectories]
        asked = [i for i in range(n) if reasonings[i]]
        semantic, statistic, logical = [0.0] * n, [0.0] * n, [0.0] * n
        if not asked:
            return {"reasoning_semantic": semantic, "reasoning_statistic": statistic, "reasoning_logical": logical}
        gen_call = self.judge.ask([self.prompt.format(reasoning=reasonings[i]) for i in asked], "triples")
        missing = sorted({r for i in asked if given[i] is None for r in refs[i]})
        ref_call = self.judge.ask([self.prompt.format(reasoning=r) for r in missing], "triples", cached=True)

        # The embeddings are computed while the judge works.
        texts = list(dict.fromkeys(plain_text(t) for i in asked for t in [reasonings[i], *refs[i]]))
        index = {t: k for k, t in enumerate(texts)}
        emb = self.encoder.encode(texts)
        extracted = dict(zip(missing, self.judge.result(ref_call)))
        for i, triples in zip(asked, self.judge.result(gen_call)):
            cos = emb[[index[plain_text(r)] for r in refs[i]]] @ emb[index[plain_text(reasonings[i])]]
            semantic[i] = semantic_score(cos.tolist())
            graphs = given[i] if given[i] is not None else \
                [normalise_triples(extracted[r]) for r in refs[i] if extracted[r] is not None]
            if triples is not None and graphs:
                graph = normalise_triples(triples)
                statistic[i] = statistic_score(graph, graphs)
                logical[i] = logical_score(graph, graphs, self.max_hops)
        return {"reasoning_semantic": semantic, "reasoning_statistic": statistic, "reasoning_logical": logical}


@register_reward("retrieval_num")
def retrieval_num(trajectories: list[Trajectory], delta: int = 3) -> dict[str, list[float]]:
    """R_retrieval_num (eq. 8): 1 if the trajectory searched at least `delta` times (turns with a query), else 0."""
    return {"retrieval_num": [retrieval_num_score(len(queries(t)), delta) for t in trajectories]}


@register_reward("med_r3_retrieval")
class MedR3Retrieval:
    """R_retrieval = R_quality + R_breadth (eq. 9), two components each in [0, 1].

    Quality: the judge grades each retrieved document's evidence level 1..6 (`evidence_prompt`; a document's level
    is cached by its text). Breadth: the share of the reasoning's triples (`triples_prompt`) whose source flag is 1;
    an unparsable graph scores 0. Both judge calls of a batch are in flight together.
    """

    def __init__(self, judge: str = "JudgeActor", evidence_prompt: str = EVIDENCE_PROMPT,
                 triples_prompt: str = TRIPLES_PROMPT, system: str | None = None, answer_tag: str = "answer"):
        self.evidence_prompt = check_template(evidence_prompt, {"document"}, "evidence_prompt")
        self.triples_prompt = check_template(triples_prompt, {"reasoning"}, "triples_prompt")
        self.judge = JudgeClient(judge, system)
        self.answer_tag = answer_tag

    def __call__(self, trajectories: list[Trajectory]) -> dict[str, list[float]]:
        docs = [[self.evidence_prompt.format(document=d) for d in retrieved_texts(t)] for t in trajectories]
        reasonings = [reasoning_text(t.text, self.answer_tag) for t in trajectories]
        asked = [i for i, r in enumerate(reasonings) if r]
        level_call = self.judge.ask([d for ds in docs for d in ds], "score", cached=True, allowed=EVIDENCE_LEVELS)
        triple_call = self.judge.ask([self.triples_prompt.format(reasoning=reasonings[i]) for i in asked], "triples")
        levels = iter(self.judge.result(level_call))
        quality = [quality_score([next(levels) for _ in ds]) for ds in docs]
        breadth = [0.0] * len(trajectories)
        for i, triples in zip(asked, self.judge.result(triple_call)):
            breadth[i] = breadth_score([t[3] for t in triples]) if triples is not None else 0.0
        return {"retrieval_quality": quality, "retrieval_breadth": breadth}

"""Retrieval as the policy meets it: hits rendered as the observation ("[i] title: passage", titles only, options
linked), and the RetrievalEnvironment that serves a batch of queries from Retriever actors, with paging. Training's
rollouts and serving's agent both show and record a search through it."""
from __future__ import annotations

from actors.environment import Environment
from actors.episode import Episode, Observation
from tasks.knowledge_base import name_key


def retrieval_text(hits: list[dict] | None, error: str | None, *, show: str = "passages",
                   options: dict[str, str] | None = None, passage_chars: int | None = None,
                   first_rank: int = 0) -> str:
    """Retrieved chunks as the policy reads them, or the failure it must reason around.

    show "passages": "[i] title: text" per hit, the text cut after `passage_chars` characters (at a word, marked
    " ...") when given, so that every hit fits a short observation; "titles": "[i] title" only.
    options (a multiple-choice question's {letter: text}): a hit whose title is an option's text is marked
    "(option X)", i.e. the retrieved documents are linked to the candidate answers. `first_rank`: the rank of the
    first hit less one (a later page of results numbers on).
    """
    if error is not None:
        return f"retrieval failed ({error}); continue without it"
    lines = (hit_header(first_rank + i, d, options) +
             (f": {passage(d['text'], passage_chars)}" if show == "passages" else "") for i, d in enumerate(hits))
    return "\n".join(lines) or "no results"


def passage(text: str, chars: int | None) -> str:
    """`text`, or its first `chars` characters up to the last whole word, marked " ..."."""
    if chars is None or len(text) <= chars:
        return text
    return text[:chars].rsplit(" ", 1)[0] + " ..."


def linked_option(hit: dict, options: dict[str, str] | None) -> str | None:
    """The letter of the option whose text is the hit's title, compared as words (`name_key`: case and punctuation
    ignored, so one disease's names in two sources link alike), or None."""
    letters = {name_key(text): letter for letter, text in (options or {}).items()}
    return letters.get(name_key(hit.get("title", "")))


def first_linked(hits: list[dict], options: dict[str, str] | None) -> tuple[int, str] | None:
    """(rank among the search's own hits, letter) of the first hit that links an option (`linked_option`), or None;
    the options' ranking (hits marked `candidate`) is not among them."""
    found = (h for h in hits if not h.get("candidate"))
    return next(((rank, letter) for rank, h in enumerate(found) if (letter := linked_option(h, options))), None)


def hit_header(rank: int, hit: dict, options: dict[str, str] | None = None) -> str:
    """'[rank+1] title', plus '(option X)' when the title is option X's text (`linked_option`)."""
    letter = linked_option(hit, options)
    return f"[{rank + 1}] {hit.get('title', '')}" + (f" (option {letter})" if letter else "")


def options_ranked(candidates: list[dict], options: dict[str, str], style: bool | str = True) -> str:
    """The line that follows hits linking no option: the options the search scores (`candidates`, best first, as a
    search `among` the options' texts returns them). Style True: in the search's order ("ranks the options C, A");
    "places": each option in the question's order with its place ("ranks option A 2nd, option C 1st"), so that the
    first letter read is not the search's choice and answering it takes reading the places."""
    letters = list(dict.fromkeys(letter for hit in candidates if (letter := linked_option(hit, options))))
    if not letters:
        return "No option is among these results, and the search matches none of them."
    if style == "places":
        place = {letter: ("1st", "2nd", "3rd")[i] if i < 3 else f"{i + 1}th" for i, letter in enumerate(letters)}
        places = ", ".join(f"option {letter} {place[letter]}" for letter in options if letter in place)
        return f"No option is among these results; the search ranks {places}."
    return f"No option is among these results; the search ranks the options {', '.join(letters)}."


class RetrievalEnvironment(Environment):
    """Queries go to a :class:`~actors.retriever.Retriever` actor (or a ShardedRetriever) in one batched call;
    each turn records the query and the retrieved chunks (ids and text), and with `link_options` on a multiple-choice
    task the letters its hits were marked with (`linked`, in rank order). `show`, `link_options` and `passage_chars`
    shape the observation (:func:`retrieval_text`). With `paging`, a query the episode already searched returns
    the next `top_k` hits (as a search engine's next page), numbered on; the turn records its `page` (1, 2, ...).
    With `rank_options` (and `link_options`), hits that link no option are followed by the options in the order the
    same search ranks them however deep (:func:`options_ranked`, in the style `rank_options` names; recorded as
    `options_ranked`, best first)."""
    role = "retriever"

    def __init__(self, retriever, top_k: int, timeout_s: float = 60.0, show: str = "passages",
                 link_options: bool = False, passage_chars: int | None = None, paging: bool = False,
                 rank_options: bool | str = False):
        self.retriever, self.top_k, self.timeout_s = retriever, top_k, timeout_s
        self.show, self.link_options, self.passage_chars, self.paging = show, link_options, passage_chars, paging
        self.rank_options = rank_options if link_options else False

    def among(self, options: dict[str, str] | None) -> list[str] | None:
        """The titles a search for a task with `options` also ranks (its options' texts), or None."""
        return list(options.values()) if self.rank_options and options else None

    def page(self, turns: list[dict], action: str) -> int:
        """Which page of `action`'s results an episode whose turn records are `turns` gets now, from 0: with paging,
        the times it searched the same query before (case and spacing ignored); else 0."""
        if not self.paging:
            return 0
        query = " ".join(action.lower().split())
        return sum(" ".join((t.get("query") or "").lower().split()) == query for t in turns)

    def page_hits(self, result: list[dict], first: int) -> list[dict]:
        """The hits of a search `result` shown on the page that starts at rank `first` (its candidates aside)."""
        return [d for d in result if not d.get("candidate")][first:first + self.top_k]

    def depth(self, turns: list[dict], action: str) -> int:
        """How many hits to search for `action` so that its current page is among them."""
        return self.top_k * (1 + self.page(turns, action))

    def call(self, episodes: list[Episode], actions: list[str]) -> list:
        depth = max(self.depth(e.turns, a) for e, a in zip(episodes, actions))
        among = [self.among(e.task.get("options")) for e in episodes]
        args = (actions, depth) + ((among,) if any(among) else ())
        search = getattr(self.retriever, "search_async", None)  # a ShardedRetriever, else an actor handle
        ref = search(*args) if search else self.retriever.search.remote(*args)
        return [(ref, i) for i in range(len(actions))]

    def observe(self, episode: Episode, action: str, result, error: str | None) -> Observation:
        return self.observation(episode.turns, episode.task.get("options"), action, result, error)

    def observation(self, turns: list[dict], options: dict[str, str] | None, action: str, result,
                    error: str | None) -> Observation:
        """The observation of `action`'s search `result` (hits in rank order, at least `depth` of them when there
        are; None with `error`) for an episode whose turn records are `turns`, on a task with `options` (a
        multiple-choice question's {letter: text}, or None): what training and serving both show and record."""
        first = self.page(turns, action) * self.top_k
        candidates = [d for d in result or [] if d.get("candidate")]
        hits = self.page_hits(result, first) if result is not None else None
        record = {"query": action, "error": error,
                  "chunks": [{"id": d["id"], "doc_id": d.get("doc_id"), "text": d["text"]} for d in hits or []]}
        if self.paging:
            record["page"] = first // self.top_k + 1
        options = options if self.link_options else None
        text = retrieval_text(hits, error, show=self.show, options=options, passage_chars=self.passage_chars,
                              first_rank=first)
        if options:  # what the policy was shown linked: the evaluation's gold-option link rates read it
            record["linked"] = [letter for d in hits or [] if (letter := linked_option(d, options))]
            if self.rank_options and error is None and not record["linked"]:
                text += "\n" + options_ranked(candidates, options, self.rank_options)
                record["options_ranked"] = [letter for d in candidates if (letter := linked_option(d, options))]
        return Observation(text, record)

    def actors(self) -> list:
        return list(getattr(self.retriever, "actors", [self.retriever]))

"""Scripted-expert demonstrations: the recipe's grammar, the real retriever's observation as a rollout shows it,
and the gold answer only when the retrieved text supports it."""
import json

from learners.config import load_config
from learners.data import read_demonstrations
from learners.expert import write_demonstrations


def test_expert_demonstrations_follow_the_grammar_and_the_real_retriever(tiny_model_path, tmp_path):
    from actors.retrieval_env import retrieval_text
    from actors.retriever import LocalRetriever
    from indexing.build_index import default_index_dir
    from transformers import AutoTokenizer

    cfg = load_config("configs/tiny.yaml")
    out = tmp_path / "demos.jsonl"
    report = write_demonstrations(cfg, "hpo:mcq_train", out, limit=40, progress=False)
    demos = read_demonstrations(out)  # the file an sft stage reads
    assert report["demonstrations"] == len(demos) > 0
    assert report["demonstrations"] + report["skipped_not_retrieved"] == 40

    g, r = cfg.rollout.grammar, cfg.retrieval
    retriever = LocalRetriever(default_index_dir(r.kb, r.index.kind, r.shards), config=r.search)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for demo in demos[:5]:
        task, (ask, observed, answer) = demo["task"], demo["segments"]
        assert [ask["role"], observed["role"], answer["role"]] == ["policy", "environment", "policy"]
        query = ask["text"].split("<query>")[1].split("</query>")[0]
        assert query.split("; ") == task["metadata"]["phenotype_names"]
        assert f"has: {query}. Which" in task["messages"][-1]["content"]  # the phenotypes the question lists
        # exactly what RetrievalEnvironment + EpisodeRunner insert: the observation, wrapped and cut
        hits = retriever.search([query], r.search.top_k)[0]
        full = tok.encode(g.wrap_observation(retrieval_text(hits, None)), add_special_tokens=False)
        assert observed["text"] == tok.decode(full[:g.max_observation_tokens], skip_special_tokens=False)
        assert answer["text"].endswith(f"<answer>{task['answer']}</answer>")
        assert task["options"][task["answer"]] in observed["text"]  # the answer is read, not guessed
    assert json.loads(out.read_text().splitlines()[0])["task"]["id"].startswith("hpo-mcq-train")


def test_linked_titles_observation_is_what_the_environment_shows(tiny_model_path, tmp_path):
    """retrieval.show=titles + link_options: hits are '[i] title', the gold one marked '(option X)', and the
    demonstration's observation is exactly what RetrievalEnvironment gives a rollout for the same hits."""
    from actors.episode import Episode
    from actors.retrieval_env import RetrievalEnvironment
    from actors.retriever import LocalRetriever
    from indexing.build_index import default_index_dir
    from transformers import AutoTokenizer

    cfg = load_config("configs/tiny.yaml", ["retrieval.show=titles", "retrieval.link_options=true"])
    out = tmp_path / "demos.jsonl"
    report = write_demonstrations(cfg, "hpo:mcq_train", out, limit=40, progress=False)
    demos = read_demonstrations(out)
    assert report["demonstrations"] == len(demos) > 0

    g, r = cfg.rollout.grammar, cfg.retrieval
    retriever = LocalRetriever(default_index_dir(r.kb, r.index.kind, r.shards), config=r.search)
    env = RetrievalEnvironment(retriever, r.search.top_k, show="titles", link_options=True)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for demo in demos[:5]:
        task, (ask, observed, answer) = demo["task"], demo["segments"]
        query = ask["text"].split("<query>")[1].split("</query>")[0]
        episode = Episode(task=task, group=0, seed=0, prompt_ids=[])
        hits = retriever.search([query], r.search.top_k)[0]
        shown = env.observe(episode, query, hits, None).text
        full = tok.encode(g.wrap_observation(shown), add_special_tokens=False)
        assert observed["text"] == tok.decode(full[:g.max_observation_tokens], skip_special_tokens=False)
        lines = shown.splitlines()
        assert len(lines) == len(hits) == r.search.top_k
        for rank, (line, hit) in enumerate(zip(lines, hits)):  # a title, maybe linked; never the passage text
            title = f"[{rank + 1}] {hit['title']}"
            assert line in [title] + [f"{title} (option {letter})" for letter in "ABCD"]
        gold = f"{task['options'][task['answer']]} (option {task['answer']})"
        assert any(line.endswith(gold) for line in lines)  # the gold hit, linked to its letter
        assert answer["text"].endswith(f"<answer>{task['answer']}</answer>")
    # a hit that is no option stays unmarked; no text follows a title
    plain = env.observe(Episode(task={"options": {"A": "Gout"}}, group=0, seed=0, prompt_ids=[]), "q",
                        [{"id": "x#0", "title": "Asthma", "text": "wheezing"},
                         {"id": "y#0", "title": "gout ", "text": "joint pain"}], None).text
    assert plain == "[1] Asthma\n[2] gout  (option A)"


def test_a_rechecking_expert_reads_the_next_page_as_a_paging_rollout_would_and_answers_from_either(tmp_path):
    """sft.expert_recheck: in that share of demonstrations the expert searches its query again and reads what
    RetrievalEnvironment's paging shows (the next top_k hits, numbered on), then answers from whichever page shows the
    gold disease; a task whose gold is on neither gets no demonstration."""
    from indexing.build_index import default_index_dir
    from actors.episode import Episode
    from actors.retrieval_env import RetrievalEnvironment
    from actors.retriever import LocalRetriever
    from learners.expert import rechecks

    cfg = load_config("configs/tiny.yaml", ["retrieval.show=titles", "retrieval.link_options=true",
                                             "retrieval.paging=true"])
    out = tmp_path / "demos.jsonl"
    write_demonstrations(cfg, "hpo:mcq_train", out, limit=200, progress=False, recheck=0.5)
    demos = read_demonstrations(out)
    paged = [d for d in demos if len(d["segments"]) == 5]
    assert 0 < len(paged) < len(demos) and all(rechecks(d["task"], 0.5) == (d in paged) for d in demos)
    for demo in demos:  # the answer's page links the gold option; only a rechecking expert answers from page 2
        link = f"(option {demo['task']['answer']})"
        pages = [seg["text"] for seg in demo["segments"][1:-1:2]]
        assert any(link in page for page in pages)
    assert any(link_only_on_second(d) for d in paged) and not any(link_only_on_second(d) for d in demos
                                                                   if d not in paged)
    r = cfg.retrieval
    env = RetrievalEnvironment(LocalRetriever(default_index_dir(r.kb, r.index.kind, r.shards), config=r.search),
                               r.search.top_k, show="titles", link_options=True, paging=True)
    for demo in paged[:3]:
        task, (ask, _, again, second, answer) = demo["task"], demo["segments"]
        query = ask["text"].split("<query>")[1].split("</query>")[0]
        assert again["text"].split("<query>")[1].split("</query>")[0] == query
        episode = Episode(task=task, group=0, seed=0, prompt_ids=[])
        hits = env.retriever.search([query], 2 * r.search.top_k)[0]
        episode.turns.append(env.observe(episode, query, hits, None).record)
        shown = env.observe(episode, query, hits, None).text
        assert shown.startswith(f"[{r.search.top_k + 1}] ") and shown.splitlines()[0] in second["text"]
        assert answer["text"].endswith(f"<answer>{task['answer']}</answer>")


def link_only_on_second(demo: dict) -> bool:
    link = f"(option {demo['task']['answer']})"
    pages = [seg["text"] for seg in demo["segments"][1:-1:2]]
    return len(pages) == 2 and link not in pages[0] and link in pages[1]


def test_expert_recheck_needs_paging():
    import pytest

    from learners.config import ConfigError
    with pytest.raises(ConfigError, match="sft.expert_recheck needs sft.data expert and retrieval.paging"):
        load_config("configs/quickstart.yaml", ["stages.0.sft.expert_recheck=0.25"])


def test_expert_left_blind_to_the_ranking_needs_one():
    import pytest

    from learners.config import ConfigError
    with pytest.raises(ConfigError, match="sft.expert_unlinked guess needs sft.data expert and "
                                          "retrieval.rank_options true"):
        load_config("configs/quickstart.yaml", ["stages.0.sft.expert_unlinked=guess",
                                                "retrieval.rank_options=false"])


def test_options_ranked_by_the_search_follow_hits_that_link_none():
    """retrieval.rank_options: hits linking no option are followed by the options in the search's order (its
    candidates); hits linking one are shown as before."""
    from actors.episode import Episode
    from actors.retrieval_env import RetrievalEnvironment

    env = RetrievalEnvironment(None, top_k=2, show="titles", link_options=True, rank_options=True)
    episode = Episode(task={"options": {"A": "Gout", "B": "Asthma", "C": "Rickets"}}, group=0, seed=0, prompt_ids=[])
    candidates = [{"id": "r#0", "title": "Rickets", "text": "", "candidate": True},
                  {"id": "g#0", "title": "Gout", "text": "", "candidate": True}]
    unlinked = env.observe(episode, "q", [{"id": "x#0", "title": "Lupus", "text": ""}] + candidates, None)
    assert unlinked.text == "[1] Lupus\nNo option is among these results; the search ranks the options C, A."
    assert unlinked.record["options_ranked"] == ["C", "A"] and unlinked.record["linked"] == []
    linked = env.observe(episode, "q", [{"id": "g#0", "title": "Gout", "text": ""}] + candidates, None)
    assert linked.text == "[1] Gout (option A)" and "options_ranked" not in linked.record
    assert env.observe(episode, "q", [], None).text == \
        "no results\nNo option is among these results, and the search matches none of them."
    assert env.among(episode.task["options"]) == ["Gout", "Asthma", "Rickets"] and env.among(None) is None
    # places: the same ranking in the question's order, each option with its place; recorded alike, best first
    env = RetrievalEnvironment(None, top_k=2, show="titles", link_options=True, rank_options="places")
    unlinked = env.observe(episode, "q", [{"id": "x#0", "title": "Lupus", "text": ""}] + candidates, None)
    assert unlinked.text == "[1] Lupus\nNo option is among these results; the search ranks option A 2nd, option C 1st."
    assert unlinked.record["options_ranked"] == ["C", "A"]


def test_the_expert_answers_from_the_options_ranking_when_no_hit_links_the_gold(tiny_model_path, tmp_path):
    """With rank_options the expert also demonstrates tasks whose gold option no hit links but the search ranks
    first of the options, reading exactly what RetrievalEnvironment shows a rollout."""
    from actors.episode import Episode
    from learners.services import retrieval_environment
    from actors.retriever import LocalRetriever
    from indexing.build_index import default_index_dir
    from transformers import AutoTokenizer

    overrides = ["retrieval.show=titles", "retrieval.link_options=true", "retrieval.rank_options=true"]
    cfg = load_config("configs/tiny.yaml", overrides)
    plain = write_demonstrations(load_config("configs/tiny.yaml", overrides[:2]), "hpo:mcq_train",
                                 tmp_path / "plain.jsonl", limit=100, progress=False)
    out = tmp_path / "demos.jsonl"
    report = write_demonstrations(cfg, "hpo:mcq_train", out, limit=100, progress=False)
    demos = read_demonstrations(out)
    ranked = [d for d in demos if "The search ranks option" in d["segments"][-1]["text"]]
    assert report["demonstrations"] == plain["demonstrations"] + len(ranked) and ranked
    # sft.expert_unlinked skip: the same environment, but only the tasks a hit links are demonstrated
    blind = write_demonstrations(cfg, "hpo:mcq_train", tmp_path / "blind.jsonl", limit=100, progress=False,
                                 unlinked="skip")
    assert blind["demonstrations"] == plain["demonstrations"]
    # guess: every task is demonstrated; those a hit links with the gold, the rest with a guess that is often wrong
    write_demonstrations(cfg, "hpo:mcq_train", tmp_path / "guess.jsonl", limit=100, progress=False, unlinked="guess")
    guesses = read_demonstrations(tmp_path / "guess.jsonl")
    guessed = [d for d in guesses if "does not settle it" in d["segments"][-1]["text"]]
    assert len(guesses) == 100 and len(guessed) == 100 - plain["demonstrations"] and guessed
    wrong = [d for d in guessed if f"<answer>{d['task']['answer']}</answer>" not in d["segments"][-1]["text"]]
    assert len(wrong) >= len(guessed) // 2
    assert all(f"<answer>{d['task']['answer']}</answer>" in d["segments"][-1]["text"]
               for d in guesses if d not in guessed)
    from learners.expert import main  # the command line follows the config's cold-start stage
    stage = "stages=[{name: cold_start, kind: sft, steps: 1, sft: {data: expert, expert_unlinked: skip}}]"
    assert main(["--config", "configs/tiny.yaml", "--data", "hpo:mcq_train", "--out", str(tmp_path / "cli.jsonl"),
                 "--limit", "100", *overrides, "total_steps=1", stage]) == 0
    assert len(read_demonstrations(tmp_path / "cli.jsonl")) == plain["demonstrations"]

    g, r = cfg.rollout.grammar, cfg.retrieval
    env = retrieval_environment(cfg, LocalRetriever(default_index_dir(r.kb, r.index.kind, r.shards), config=r.search))
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for demo in ranked[:5]:
        task, (ask, observed, answer) = demo["task"], demo["segments"]
        query = ask["text"].split("<query>")[1].split("</query>")[0]
        result = env.retriever.search([query], r.search.top_k, [env.among(task["options"])])[0]
        shown = env.observe(Episode(task=task, group=0, seed=0, prompt_ids=[]), query, result, None).text
        full = tok.encode(g.wrap_observation(shown), add_special_tokens=False)
        assert observed["text"] == tok.decode(full[:g.max_observation_tokens], skip_special_tokens=False)
        assert "(option" not in observed["text"]
        assert f"the search ranks the options {task['answer']}" in observed["text"]
        assert answer["text"].endswith(f"<answer>{task['answer']}</answer>")


def test_an_unlinked_mix_holds_every_question_whose_first_page_links_no_option_at_the_share_asked():
    import pytest
    from learners.unlinked_mix import unlinked_mix

    tasks = [{"id": i} for i in range(10)]
    linked = [i not in (2, 7) for i in range(10)]  # 2 unlinked, 8 linked
    mix = unlinked_mix(tasks, linked, share=0.5)
    assert len(mix) == 4 and {2, 7} <= {t["id"] for t in mix}
    assert len(unlinked_mix(tasks, linked, share=0.25)) == 8
    assert len(unlinked_mix(tasks, linked, share=0.1)) == 10  # fewer linked exist than the share asks: all of them
    assert unlinked_mix(tasks, linked, 0.5, seed=1) == unlinked_mix(tasks, linked, 0.5, seed=1)
    with pytest.raises(ValueError, match="--share 0"):
        unlinked_mix(tasks, linked, share=0)


def test_first_page_links_are_the_option_marks_the_environment_shows(tiny_model_path):
    from actors.retrieval_env import retrieval_text
    from actors.retriever import LocalRetriever
    from learners.data import load_tasks
    from learners.expert import expert_query
    from learners.unlinked_mix import first_page_links
    from learners.services import ensure_run_index

    cfg = load_config("configs/tiny.yaml")
    tasks = load_tasks("hpo:mcq_train")[:60]
    linked = first_page_links(cfg, tasks)
    assert 0 < sum(linked) < len(tasks)  # the tiny index links some questions' options and not others'
    retriever = LocalRetriever(ensure_run_index(cfg), config=cfg.retrieval.search)
    for task, link in zip(tasks, linked):
        page = retriever.search([expert_query(task)], cfg.retrieval.search.top_k)[0]  # no options' ranking
        shown = retrieval_text(page, None, show="titles", options=task["options"])
        assert link == ("(option " in shown), task["id"]

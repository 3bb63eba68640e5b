"""The episode loop and turn logic training's EpisodeRunner and serving's agent both run (`actors.episode.play`,
`actors.episode.Episode`), by hand: what a generation and an observation do to an episode, and why it ends."""
import pytest

from actors.episode import Act, Episode, Generate, Generation, Observation, next_request, play
from actors.grammar import Grammar


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_path)


def asking(text: str = "<query>gout</query>", n: int = 5) -> Generation:
    return Generation(text, list(range(10, 10 + n)), [-0.5] * n, "stop", "</query>")


def test_a_closed_action_goes_to_the_environment_and_its_observation_is_masked(tokenizer):
    grammar = Grammar(action_tag="query", max_turns=2, max_response_tokens=200, max_observation_tokens=50)
    ep = Episode(task={}, group=0, seed=7, prompt_ids=[1, 2])
    assert ep.sampling_seed() == 7 and ep.room(grammar) == 200
    assert ep.generated(grammar, asking("think <query> gout </query>")) == "gout"
    assert ep.loss_mask == [1] * 5 and ep.logprobs == [-0.5] * 5 and not ep.finish_reason
    assert ep.observed(grammar, Observation("Gout: joint pain", {"query": "gout"}), tokenizer, None)
    shown = tokenizer.encode(grammar.wrap_observation("Gout: joint pain"), add_special_tokens=False)
    assert ep.response_ids == list(range(10, 15)) + shown and ep.loss_mask == [1] * 5 + [0] * len(shown)
    assert ep.logprobs[5:] == [0.0] * len(shown) and ep.turns == [{"query": "gout"}]
    assert ep.sampling_seed() not in (None, 7)  # each turn samples with its own derived seed
    assert ep.engine_prompt(None) == {"prompt_token_ids": [1, 2] + ep.response_ids}
    # a continued message's text before the generation is where serving reads the action from
    assert Episode(task={}, group=0, seed=None, prompt_ids=[1]).generated(
        grammar, asking("</query>"), segment="<query>marfan</query>") == "marfan"


def test_the_loop_asks_for_a_generation_then_the_environment_until_the_episode_ends(tokenizer):
    grammar = Grammar(action_tag="query", max_turns=2, max_response_tokens=200, max_observation_tokens=50)
    ep = Episode(task={}, group=0, seed=7, prompt_ids=[1, 2])
    loop = play(ep, grammar, tokenizer, limit=lambda _: 64, prefix="<query>marfan")
    first = next_request(loop)
    assert first == Generate({"prompt_token_ids": [1, 2]}, 64, 7)  # the driver's limit is below the grammar's room
    # the first turn's action is read with the continued message's text before it
    assert next_request(loop, asking(" syndrome</query>")) == Act("marfan syndrome")
    second = next_request(loop, Observation("Marfan syndrome: tall", {"query": "marfan syndrome"}))
    assert isinstance(second, Generate) and second.prompt == {"prompt_token_ids": [1, 2] + ep.response_ids}
    assert second.seed not in (None, 7) and ep.turns == [{"query": "marfan syndrome"}]
    answer = Generation("<answer>B</answer>", [3, 4], [-1.0, -1.0], "stop", "</answer>")
    assert next_request(loop, answer) is None and ep.finish_reason == "stop"


def test_the_loop_ends_with_budget_when_the_driver_leaves_no_room(tokenizer):
    grammar = Grammar(action_tag="query", max_turns=4, max_response_tokens=200, max_observation_tokens=50)
    ep = Episode(task={}, group=0, seed=0, prompt_ids=[1])
    written = {"tokens": 0}
    loop = play(ep, grammar, tokenizer, limit=lambda _: 5 - written["tokens"])
    assert next_request(loop).max_tokens == 5
    written["tokens"] = 5
    assert next_request(loop, asking()) == Act("gout")
    assert next_request(loop, Observation("Gout", {"query": "gout"})) is None and ep.finish_reason == "budget"


@pytest.mark.parametrize("generation,finish", [
    (Generation("<answer>B</answer>", [3, 4], [-1.0, -1.0], "stop", "</answer>"), "stop"),
    (Generation("rambling", [3, 4], [-1.0, -1.0], "length"), "length"),
    (Generation("<query>x</query>", [3, 4], [-1.0, -1.0], "stop", "</query>"), "turn_limit"),
], ids=["answer", "length", "turn_limit"])
def test_a_generation_that_asks_nothing_or_past_the_turn_limit_ends_the_episode(generation, finish):
    grammar = Grammar(action_tag="query", max_turns=0)
    ep = Episode(task={}, group=0, seed=0, prompt_ids=[1])
    assert ep.generated(grammar, generation) is None and ep.finish_reason == finish and ep.loss_mask == [1, 1]


def test_the_budget_cuts_the_observation_and_ends_the_episode(tokenizer):
    grammar = Grammar(action_tag="query", max_turns=4, max_response_tokens=8, max_observation_tokens=50)
    ep = Episode(task={}, group=0, seed=0, prompt_ids=[1])
    assert ep.generated(grammar, asking()) == "gout"
    assert not ep.observed(grammar, Observation("a long list of hits " * 5), tokenizer, None)
    assert ep.finish_reason == "budget" and len(ep.response_ids) == 8 and ep.loss_mask[5:] == [0, 0, 0]
    # an action closed with the budget already spent never reaches the environment
    full = Episode(task={}, group=0, seed=0, prompt_ids=[1])
    assert full.generated(grammar, asking(n=8)) is None and full.finish_reason == "budget"


def test_the_environment_ends_an_episode_with_its_own_reason(tokenizer):
    grammar = Grammar(action_tag="tool_call", observation_tag="tool_response")
    ep = Episode(task={}, group=0, seed=0, prompt_ids=[1])
    done = Observation("already called", {"finish": "repeated_call"}, done=True)
    assert not ep.observed(grammar, done, tokenizer, None) and ep.finish_reason == "repeated_call"
    assert not Episode(task={}, group=0, seed=0, prompt_ids=[1]).observed(
        grammar, Observation("bye", done=True), tokenizer, None)


def test_images_from_the_environment_need_a_model_that_sees(tokenizer):
    import numpy as np

    ep = Episode(task={"id": "scan-3"}, group=0, seed=0, prompt_ids=[1])
    with pytest.raises(ValueError, match="1 images for task 'scan-3', but the policy model is text-only"):
        ep.observed(Grammar(), Observation("zoomed", images=[np.zeros((8, 8, 3), np.uint8)]), tokenizer, None)


def test_a_token_only_images_bring_ends_the_turn_and_is_dropped():
    from types import SimpleNamespace

    vision = SimpleNamespace(special_ids=[99])  # what Episode reads of a policy's ImageTokens here
    ep = Episode(task={}, group=0, seed=0, prompt_ids=[1])
    stray = Generation("look <|image_pad|>", [5, 6, 99], [-0.1, -0.2, -0.3], "stop", 99)
    assert ep.generated(Grammar(action_tag="query"), stray, vision=vision) is None
    assert ep.finish_reason == "vision_token" and ep.response_ids == [5, 6] and ep.logprobs == [-0.1, -0.2]
    assert ep.engine_prompt(None) == {"prompt_token_ids": [1, 5, 6]}

"""The multi-turn workload generator with the real SmolLM2 tokenizer: deterministic text, exact
token counts through the chat template, turn structure, and replies carried into the next turn."""

from __future__ import annotations

import pytest

from kvtier.bench.multiturn.conversation import Conversation, WorkloadSpec, chat_ids

SPEC = WorkloadSpec(initial_tokens=400, tokens_per_turn=120, turns=4, conversations=3,
                    max_concurrency=2, output_tokens=8, seed=7)
REPLIES = ("The council approved it.", "It was postponed because the costs had risen twice.",
           "Ask about the budget.")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvtier.tools.models import prepare_smollm2

    return AutoTokenizer.from_pretrained(str(prepare_smollm2(quiet=True)))


def _play(tokenizer, spec: WorkloadSpec, index: int, tag: str = "t") -> tuple[Conversation, list[list[int]]]:
    conv = Conversation(index, spec, tokenizer, tag)
    prompts = []
    for turn in range(spec.turns):
        conv.ask()
        prompts.append(conv.prompt_ids())
        conv.answer(REPLIES[turn % len(REPLIES)])
    return conv, prompts


def test_same_seed_and_tag_give_the_same_text_other_ones_differ(tokenizer) -> None:
    a, prompts_a = _play(tokenizer, SPEC, 0)
    b, prompts_b = _play(tokenizer, SPEC, 0)
    assert a.messages == b.messages and prompts_a == prompts_b
    other_conv, _ = _play(tokenizer, SPEC, 1)
    other_tag, _ = _play(tokenizer, SPEC, 0, tag="u")
    other_seed, _ = _play(tokenizer, WorkloadSpec(**{**SPEC.as_json(), "seed": 8}), 0)
    for other in (other_conv, other_tag, other_seed):
        assert other.messages[1]["content"] != a.messages[1]["content"]
    assert a.messages[0] == other_conv.messages[0]  # one system prompt for everyone


@pytest.mark.parametrize(("initial", "per_turn"), [(400, 120), (800, 200), (1500, 64)])
def test_prompts_have_the_exact_token_counts(tokenizer, initial: int, per_turn: int) -> None:
    spec = WorkloadSpec(initial, per_turn, 4, 1, 1, 8)
    conv = Conversation(0, spec, tokenizer, "sizes")
    previous_with_reply = 0
    for turn in range(spec.turns):
        conv.ask()
        prompt = conv.prompt_ids()
        assert len(prompt) - previous_with_reply == (initial if turn == 0 else per_turn)
        conv.answer(REPLIES[turn % len(REPLIES)])
        previous_with_reply = len(chat_ids(tokenizer, conv.messages, generation_prompt=False))
    # prompt n = initial + (n-1) x per turn + the earlier replies with their markup
    assert len(prompt) > initial + 3 * per_turn
    assert len(prompt) < spec.max_prompt_tokens() + spec.output_tokens


def test_turn_structure_and_replies_carried_over(tokenizer) -> None:
    conv, prompts = _play(tokenizer, SPEC, 2)
    assert [m["role"] for m in conv.messages] == ["system"] + ["user", "assistant"] * SPEC.turns
    assert conv.finished and conv.turn == SPEC.turns
    for turn in range(1, SPEC.turns):
        # every prompt extends the previous one, and carries the reply to it
        assert prompts[turn][:len(prompts[turn - 1])] == prompts[turn - 1]
        text = tokenizer.decode(prompts[turn])
        assert REPLIES[(turn - 1) % len(REPLIES)] in text
    first_user = conv.messages[1]["content"]
    assert first_user.startswith("Please read this report") and "\n\nQuestion: " in first_user
    assert conv.messages[3]["content"].startswith("Here is the next part of the report.")
    # the report continues across turns: the follow-up does not repeat the opening's text
    assert conv.messages[3]["content"].split("\n\n")[0][40:120] not in first_user


def test_misuse_and_bad_sizes_are_refused(tokenizer) -> None:
    conv = Conversation(0, SPEC, tokenizer, "x")
    with pytest.raises(RuntimeError, match="no question"):
        conv.answer("early")
    conv.ask()
    with pytest.raises(RuntimeError, match="no answer yet"):
        conv.ask()
    with pytest.raises(ValueError, match="--initial-tokens 40"):
        Conversation(0, WorkloadSpec(40, 100, 2, 1, 1, 4), tokenizer, "x").ask()
    small = Conversation(0, WorkloadSpec(300, 5, 2, 1, 1, 4), tokenizer, "x")
    small.ask()
    small.answer("ok")
    with pytest.raises(ValueError, match="--tokens-per-turn 5"):
        small.ask()
    with pytest.raises(ValueError, match="--output-tokens 0"):
        WorkloadSpec(300, 100, 2, 1, 1, 0).check()

"""The verifiable task: sort a string of digits, scored with partial credit.

A prompt is ``n`` random digits followed by ``=`` (``"31415="``); the answer is the same digits in
ascending order (``"11345"``), then end-of-sequence. The reward is programmatic:
:func:`sort_reward` gives the fraction of answer positions that are right, so a policy that gets
most digits right earns most of the reward and GRPO has a dense signal to climb.

The tokenizer is defined here in code (no download is possible): one token per character, plus
``<pad>``, ``<bos>`` and ``<eos>``. ``--model PATH`` runs use the checkpoint's own Hugging Face
tokenizer through :class:`HFTokenizer`, which exposes the same small interface.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol, Sequence

__all__ = ["Tokenizer", "CharTokenizer", "HFTokenizer", "SortTask", "CopyTask", "sort_reward"]


class Tokenizer(Protocol):
    """What the recipe needs from a tokenizer (ids are ``int`` token ids)."""

    pad_id: int
    eos_id: int
    bos_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
    """One token per character of ``alphabet``; ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``.

    Args:
        alphabet: the characters the task uses, each a single token (ids ``3 ...``).

    Raises:
        ValueError: ``encode`` meets a character outside ``alphabet``.
    """

    pad_id, bos_id, eos_id = 0, 1, 2
    _SPECIAL = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str = "0123456789=") -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self._ids = {c: i + len(self._SPECIAL) for i, c in enumerate(alphabet)}
        self.vocab_size = len(self._SPECIAL) + len(alphabet)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer alphabet {self.alphabet!r}") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Characters up to the first ``<eos>`` or ``<pad>``; ``<bos>`` and unknown ids read as ``?``."""
        out = []
        for i in ids:
            i = int(i)
            if i in (self.eos_id, self.pad_id):
                break
            j = i - len(self._SPECIAL)
            out.append(self.alphabet[j] if 0 <= j < len(self.alphabet) else "?")
        return "".join(out)


class HFTokenizer:
    """Adapts a Hugging Face tokenizer (``--model PATH``) to :class:`Tokenizer`.

    Args:
        path: a local checkpoint folder with tokenizer files.
    """

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        if self._tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} has no eos token; the task needs one to end answers")
        self.eos_id = int(self._tok.eos_token_id)
        self.pad_id = int(self._tok.pad_token_id) if self._tok.pad_token_id is not None else self.eos_id
        self.bos_id = int(self._tok.bos_token_id) if self._tok.bos_token_id is not None else None
        self.vocab_size = len(self._tok)
        unknown = [c for c in "0123456789" if not self.encode(c)]
        if unknown:  # transformers builds an empty tokenizer from a folder without tokenizer files
            raise ValueError(
                f"the tokenizer in {path} encodes the task's digits {unknown} as nothing (vocabulary of "
                f"{self.vocab_size}): the folder has no usable tokenizer files (tokenizer.json, or a vocabulary "
                "and merges). Save the tokenizer next to the model (tokenizer.save_pretrained(path))")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode(ids, skip_special_tokens=True)


def sort_reward(response: str, target: str) -> float:
    """Partial-credit reward of ``response`` for the sorted string ``target``.

    The fraction of positions ``i`` with ``response[i] == target[i]``, over the longer of the two
    lengths, so a missing, extra or wrong character each costs one position:
    ``sort_reward("11345", "11345") == 1.0``, ``sort_reward("11354", "11345") == 0.6``,
    ``sort_reward("1134", "11345") == 0.8``, ``sort_reward("", "11345") == 0.0``.

    Args:
        response: the decoded answer (up to end-of-sequence; surrounding spaces are ignored).
        target: the correct answer.

    Returns:
        A reward in ``[0, 1]``; ``1.0`` exactly when ``response == target``.
    """
    response = response.strip()
    n = max(len(response), len(target))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, target)) / n


@dataclass(frozen=True, kw_only=True)
class SortTask:
    """Prompts of ``digits`` random digits; the answer sorts them ascending."""

    digits: int = 5
    """Digits per prompt (the answer has as many, then end-of-sequence)."""

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 32:
            raise ValueError(f"SortTask.digits must be in [1, 32], got {self.digits}")

    @property
    def max_new_tokens(self) -> int:
        """Tokens a generator may produce: the answer plus end-of-sequence (character tokenizer)."""
        return self.digits + 1

    def problem(self, rng: random.Random) -> tuple[str, str]:
        """One ``(prompt, answer)`` pair, e.g. ``("31415=", "11345")``."""
        d = "".join(rng.choice("0123456789") for _ in range(self.digits))
        return d + "=", "".join(sorted(d))

    def noisy_answer(self, answer: str, rng: random.Random, noise: float) -> str:
        """``answer`` with each digit replaced by a uniformly random digit with probability ``noise``
        (the imperfect demonstrator of the warm start)."""
        return "".join(rng.choice("0123456789") if rng.random() < noise else c for c in answer)

    def reward(self, response: str, answer: str) -> float:
        return sort_reward(response, answer)


@dataclass(frozen=True, kw_only=True)
class CopyTask(SortTask):
    """:class:`SortTask`'s prompts; the answer repeats the digits in their order (the LoRA recipe's
    warm-up task and its ``--task copy``)."""

    def problem(self, rng: random.Random) -> tuple[str, str]:
        """One ``(prompt, answer)`` pair, e.g. ``("31415=", "31415")``."""
        prompt, _ = super().problem(rng)
        return prompt, prompt[:-1]

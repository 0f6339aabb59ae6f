"""``synthetic-text``: a small causal transformer language model on generated text.

Every sample is made in ``__getitem__``, as a text pipeline reads and tokenises a document:
a sentence sequence drawn from a fixed random grammar (a Markov chain over a generated
vocabulary, seeded by the index, so the same index always gives the same text), joined into
a string, tokenised character by character in Python, cut or padded to ``seq_len``. Batches
are dicts (``input_ids``, ``attention_mask``, ``labels``) that the default collate stacks,
and the model returns an object with ``.loss``, as a Hugging Face model does: the workload
brings its own step (``train_step = model(**batch).loss``). Nothing is downloaded.

The text has structure a model can learn (which word follows which), so the validation loss
falls with training and batch size's convergence cost shows. Tokenising in Python costs
tens of microseconds per sample: on a small CPU loading and the model's step are of one
order, and the loader settings matter.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from loader_search._rules import Range, check_options
from loader_search.workloads._base import Workload

PAD = 0
ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"
VOCAB_SIZE = len(ALPHABET) + 1  # + the padding id 0


def make_grammar(words: int, seed: int) -> tuple[list[str], list[list[int]]]:
    """A generated vocabulary of ``words`` words and, for each, the few words that may
    follow it (the structure the model learns)."""
    rng = random.Random(seed)
    letters = ALPHABET[:26]
    vocabulary = sorted(
        {"".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(words)}
    )
    follows = [rng.sample(range(len(vocabulary)), k=min(4, len(vocabulary))) for _ in vocabulary]
    return vocabulary, follows


class TextDataset(Dataset[dict[str, torch.Tensor]]):
    """Generated documents, tokenised per access (see the module docstring)."""

    def __init__(
        self,
        size: int,
        seq_len: int,
        grammar: tuple[list[str], list[list[int]]],
        offset: int = 0,
    ) -> None:
        self.size = size
        self.seq_len = seq_len
        self.vocabulary, self.follows = grammar
        self.offset = offset  # validation documents are other indices' than training ones
        self.ids = {c: i + 1 for i, c in enumerate(ALPHABET)}

    def __len__(self) -> int:
        return self.size

    def text(self, index: int) -> str:
        """Document ``index``: sentences of 4-12 words, each word one that may follow the
        one before."""
        rng = random.Random(self.offset + index)
        words: list[str] = []
        length = 0
        word = rng.randrange(len(self.vocabulary))
        while length <= self.seq_len:
            sentence = []
            for _ in range(rng.randint(4, 12)):
                sentence.append(self.vocabulary[word])
                word = rng.choice(self.follows[word])
            text = " ".join(sentence) + rng.choice(".,") + " "
            words.append(text)
            length += len(text)
        return "".join(words)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = [self.ids[c] for c in self.text(index)][: self.seq_len + 1]
        ids += [PAD] * (self.seq_len + 1 - len(ids))
        tokens = torch.tensor(ids, dtype=torch.long)
        inputs, labels = tokens[:-1], tokens[1:].clone()
        labels[labels == PAD] = -100  # not scored
        return {"input_ids": inputs, "attention_mask": inputs != PAD, "labels": labels}


@dataclass
class LMOutput:
    """What `TinyLM` returns, as a Hugging Face causal LM does."""

    loss: torch.Tensor
    logits: torch.Tensor


class TinyLM(nn.Module):
    """A causal transformer: token and position embeddings, ``layers`` pre-norm encoder
    layers under a causal mask, a linear head."""

    def __init__(self, seq_len: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB_SIZE, width, padding_idx=PAD)
        self.positions = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB_SIZE)
        mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> LMOutput:
        n = input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions[:n]
        causal: torch.Tensor = self.causal  # type: ignore[assignment]
        x = self.body(x, mask=causal[:n, :n], is_causal=True)
        logits = self.head(x)
        loss = torch.zeros((), device=logits.device)
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB_SIZE).float(), labels.reshape(-1), ignore_index=-100
            )
        return LMOutput(loss, logits)


def adamw(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The text workload's optimiser: AdamW (transformers train poorly with plain SGD)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The workload's own step: the batch's mean loss, the model's ``.loss``."""
    loss: torch.Tensor = model(**batch).loss
    return loss


OPTION_RULES = {
    "train_size": Range(1, 10**8),
    "val_size": Range(1, 10**8),
    "seq_len": Range(2, 4096),
    "width": Range(4, 4096),
    "layers": Range(1, 64),
    "words": Range(2, 100_000),
    "seed": Range(0, 2**32 - 1),
}


def synthetic_text(
    train_size: int = 4096,
    val_size: int = 512,
    seq_len: int = 64,
    width: int = 32,
    layers: int = 1,
    words: int = 400,
    seed: int = 0,
) -> Workload:
    """Build the ``synthetic-text`` workload (see the module docstring)."""
    check_options(locals(), OPTION_RULES)
    if width % 4:
        raise ValueError(f"width = {width}: must be a multiple of the 4 attention heads")
    grammar = make_grammar(words, seed)
    return Workload(
        name="synthetic-text",
        train_dataset=TextDataset(train_size, seq_len, grammar, offset=seed * 10**9),
        val_dataset=TextDataset(val_size, seq_len, grammar, offset=seed * 10**9 + 10**8),
        make_model=functools.partial(TinyLM, seq_len, width, layers),
        train_step=lm_step,
        make_optimizer=adamw,
        base_lr=3e-3,
        description=(
            f"generated text: {train_size} train / {val_size} val documents of {seq_len}"
            f" characters, tokenised per sample; causal transformer ({layers} layers,"
            f" width {width}); dict batches, its own step"
        ),
        options={
            "train_size": train_size,
            "val_size": val_size,
            "seq_len": seq_len,
            "width": width,
            "layers": layers,
            "words": words,
            "seed": seed,
        },
    )

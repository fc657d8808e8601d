"""A transformer whose Adam state does not fit the memory a worker may use, trained at 4 workers by
sharding its parameters, gradients and optimizer state (px.Sharded, level 3).

    phalanx run -n 4 examples/sharded_transformer.py              # level 3: fits, and learns
    phalanx run -n 4 examples/sharded_transformer.py --level 0    # unsharded: refused before training,
                                                                  # naming the memory and the level that fits
    phalanx run -n 4 examples/sharded_transformer.py --samples 256   # a quick look: four steps

Each worker may hold MAX_MEMORY_GB for parameters, gradients and optimizer state. The model has
about 3.2 M parameters: unsharded, AdamW makes that 16 bytes each, 0.048 GiB on every worker; level
2 still keeps every parameter whole on each worker (0.021 GiB at 4 workers); level 3 keeps a quarter
of everything (0.012 GiB, plus the block being computed). The text is phalanx's own documentation,
learnt character by character.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px

MAX_MEMORY_GB = 0.02  # per worker: parameters, gradients and optimizer state
SEQUENCE, WIDTH, LAYERS, HEADS = 64, 256, 4, 4

parser = argparse.ArgumentParser()
parser.add_argument("--level", type=int, default=3, help="0: unsharded px.DataParallel; 1-3: px.Sharded(level)")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--samples", type=int, default=None, help="train on the first SAMPLES windows only (a quick look)")
args = parser.parse_args()

root = Path(__file__).resolve().parents[1]
text = "\n".join(path.read_text() for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
alphabet = sorted(set(text))
codes = torch.tensor([alphabet.index(c) for c in text])
windows = codes[: len(codes) // (SEQUENCE + 1) * (SEQUENCE + 1)].view(-1, SEQUENCE + 1)
inputs, targets = windows[: args.samples, :-1], windows[: args.samples, 1:]


class CharacterModel(nn.Module):
    """A causal transformer over characters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(alphabet), WIDTH)
        self.position = nn.Parameter(torch.zeros(SEQUENCE, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, len(alphabet))
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(SEQUENCE), persistent=False)

    def forward(self, characters: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(characters) + self.position[: characters.shape[1]]
        return self.head(self.layers(hidden, mask=self.causal, is_causal=True))


def next_character_loss(logits: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), expected.flatten())


def held_out_loss() -> float:
    """The loss on the text's last 64 windows, which training never reads (the whole model, on each worker)."""
    with torch.no_grad():
        return next_character_loss(model(held_out[0]), held_out[1]).item()


held_out = windows[-64:, :-1], windows[-64:, 1:]
inputs, targets = inputs[: len(windows) - 64], targets[: len(windows) - 64]
torch.manual_seed(0)
model = CharacterModel()
before = held_out_loss()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
strategy = px.Sharded(level=args.level, fusion_threshold_mb=4) if args.level else None
history = px.fit(model, optimizer, next_character_loss, (inputs, targets), epochs=args.epochs, global_batch_size=64,
                 strategy=strategy, max_memory_gb=MAX_MEMORY_GB, verbose=0)
if px.is_master():  # px.fit handed the whole trained model back to every worker
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, level {args.level}, {px.size()} workers: "
          f"held-out loss {before:.2f} before training -> {held_out_loss():.2f} after {args.epochs} epoch(s) "
          f"(training loss {history['loss'][0]:.2f} in epoch 0 -> {history['loss'][-1]:.2f} in epoch {args.epochs - 1})")

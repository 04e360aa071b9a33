"""A Hugging Face causal LM (GPT-2 layout, built from a config: nothing downloaded) trained
data-parallel with ddpkit's public API; batches are dicts, the model computes its own loss.

    ddpkit run --nproc 2 examples/lm_hf.py --epochs 1     # needs: pip install 'ddpkit[hf]'
"""
import argparse
import inspect
import math

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import ddpkit


class Bytes(Dataset):
    """Byte windows of the standard library's argparse source, as the dicts HF models take."""

    def __init__(self, train: bool, context: int = 64):
        import argparse as corpus
        raw = torch.tensor(list(inspect.getsource(corpus).encode()), dtype=torch.long)
        windows = raw[: len(raw) // context * context].view(-1, context)
        split = int(0.9 * len(windows))
        self.ids = windows[:split] if train else windows[split:]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}   # the model shifts the labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the final metrics and weights here")
    args = parser.parse_args()

    rt = ddpkit.setup(seed=0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = rt.wrap(GPT2LMHeadModel(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = rt.loader(Bytes(train=True), batch_size=args.batch_size)
    ddpkit.fit(rt, model, optimizer, loader, epochs=args.epochs, max_steps=args.max_steps,
               eval_data=None, progress=False)        # the model's own .loss trains it
    final = rt.evaluate(model, Bytes(train=False), per_rank_batch=64, topk=(1,))  # exact, per token
    rt.print0(f"validation loss {final['loss']:.4f}, perplexity {math.exp(final['loss']):.2f} "
              f"over {final['count']} tokens")
    if rt.is_main and args.out:
        torch.save({"metrics": final, "weights": rt.unwrap(model).state_dict()}, args.out)


if __name__ == "__main__":
    main()

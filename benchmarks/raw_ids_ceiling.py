#!/usr/bin/env python3
"""The AUC a model of a raw-id config can reach at most: the planted model's, but knowing the
effects only of ids seen in training (at least m times), where the printed `oracle_auc` knows every
id's. With new ids entering as the hottest every batch, evaluation draws many ids that training has
seen a few times or never; no model learns an effect it has not seen.

    python benchmarks/raw_ids_ceiling.py [CONFIG] [--eval-batches 8] [--steps N]

Reads the config's synthetic data, batch size and steps (one process), counts each id's
occurrences in the training batches, and evaluates on the batches the runner evaluates on at the
run's end (numbered from 2**40, drawn from the vocabulary where training is).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlkv_torch.config import cardinalities_of, load_config  # noqa: E402
from mlkv_torch.data.synthetic import SyntheticCTR, binary_auc  # noqa: E402

_EVAL_FIRST_BATCH = 1 << 40  # as the runner's evaluation (train/sources.py)


def seen_counts(generator: SyntheticCTR, steps: int, batch_size: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Each feature's distinct training ids (sorted) and how often each was drawn."""
    drawn = [generator.batch_ids(b, batch_size) for b in range(steps)]
    return [torch.cat([ids[:, f] for ids in drawn]).unique(return_counts=True)
            for f in range(len(generator.cardinalities))]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="configs/raw_ids.yaml")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the config's)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    s, batch_size = config.data.synthetic, config.train.batch_size
    steps = args.steps or config.train.steps
    generator = SyntheticCTR(cardinalities=cardinalities_of(s.cardinalities, s.scale), zipf=s.zipf,
                             id_space=s.id_space, new_ids_per_batch=s.new_ids_per_batch, seed=config.train.seed)
    seen = seen_counts(generator, steps, batch_size)
    drawn = [generator.batch(_EVAL_FIRST_BATCH + k, batch_size, steps) for k in range(args.eval_batches)]
    dense, ids, labels, probability = (torch.cat([d[i] for d in drawn]) for i in range(4))
    print(f"{args.config}: {steps} steps of {batch_size}; AUC on {len(labels):,} evaluation samples")
    print(f"  the planted model (oracle_auc): {binary_auc(probability, labels):.4f}")
    for least in (1, 3, 10, 30):
        logit = generator.bias + dense @ generator.dense_weights
        for f, (known_ids, counts) in enumerate(seen):
            at = torch.searchsorted(known_ids, ids[:, f].contiguous()).clamp(max=len(known_ids) - 1)
            known = (known_ids[at] == ids[:, f]) & (counts[at] >= least)
            logit = logit + torch.where(known, generator.effects(f, ids[:, f]), torch.zeros(()))
        print(f"  knowing the effects of ids seen >= {least} times: {binary_auc(torch.sigmoid(logit), labels):.4f}")
    dense_only = torch.sigmoid(generator.bias + dense @ generator.dense_weights)
    print(f"  the dense features alone: {binary_auc(dense_only, labels):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

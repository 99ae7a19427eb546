"""The row-wise optimizer rules against the in-memory references they promise to match."""
import pytest
import torch

from mlkv_torch import optim

NUM, DIM, STEPS = 50, 8, 6


def bags(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, NUM, (40,), generator=g)
    ids[:6] = 3  # repeated ids: their gradients must be summed before the update
    offsets = torch.arange(0, 40, 4)
    target = torch.randn(10, DIM, generator=g)
    return ids, offsets, target


def run_rows(opt: optim.SparseOptimizer, initial: torch.Tensor) -> torch.Tensor:
    """Our rule, fed the coalesced sparse gradient of an nn.EmbeddingBag."""
    weights = initial.clone()
    state = opt.initial_state(NUM, DIM)
    for step in range(1, STEPS + 1):
        ids, offsets, target = bags(step)
        emb = torch.nn.EmbeddingBag(NUM, DIM, mode="sum", sparse=True, _weight=weights.clone())
        (emb(ids, offsets) * target).sum().backward()
        grad = emb.weight.grad.coalesce()
        rows = grad.indices()[0]
        w, s = weights[rows], state[rows]
        opt.update(w, s, grad.values(), step)
        weights[rows], state[rows] = w, s
    return weights


def run_reference(make_opt, initial: torch.Tensor) -> torch.Tensor:
    emb = torch.nn.EmbeddingBag(NUM, DIM, mode="sum", sparse=True, _weight=initial.clone())
    opt = make_opt([emb.weight])
    for step in range(1, STEPS + 1):
        ids, offsets, target = bags(step)
        opt.zero_grad()
        (emb(ids, offsets) * target).sum().backward()
        opt.step()
    return emb.weight.detach()


@pytest.mark.parametrize("ours, reference", [
    (optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    (optim.Adagrad(lr=0.1, eps=1e-10, initial_accumulator_value=0.1),
     lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10, initial_accumulator_value=0.1)),
    (optim.Adagrad(lr=0.05), lambda p: torch.optim.Adagrad(p, lr=0.05)),
    (optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-8), lambda p: torch.optim.SparseAdam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-8)),
], ids=["sgd", "adagrad-init", "adagrad", "adam"])
def test_rule_matches_torch_optimizer(ours, reference):
    initial = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(run_rows(ours, initial), run_reference(reference, initial))


def test_rowwise_adagrad_matches_fbgemm_exact_rowwise_adagrad():
    tbe_mod = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice

    lr, eps = 0.05, 1e-8
    initial = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(1))
    tbe = tbe_mod.SplitTableBatchedEmbeddingBagsCodegen(
        [(NUM, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps)
    tbe.split_embedding_weights()[0].copy_(initial)
    for step in range(1, STEPS + 1):
        ids, offsets, target = bags(step)
        out = tbe(ids, torch.cat([offsets, torch.tensor([ids.numel()])]))
        (out * target).sum().backward()  # fbgemm applies the optimizer inside backward
    torch.testing.assert_close(run_rows(optim.RowWiseAdagrad(lr=lr, eps=eps), initial),
                               tbe.split_embedding_weights()[0].detach())


def test_state_layout_and_validation():
    assert optim.SGD(lr=1).state_dim(16) == 0
    assert optim.Adagrad().state_dim(16) == 16
    assert optim.RowWiseAdagrad().state_dim(16) == 1
    assert optim.Adam().state_dim(16) == 32
    torch.testing.assert_close(optim.Adagrad(initial_accumulator_value=0.5).initial_state(2, 3), torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="lr"):
        optim.SGD(lr=0)
    with pytest.raises(ValueError, match="betas"):
        optim.Adam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        optim.Adagrad(initial_accumulator_value=-1)
    with pytest.raises(ValueError, match="step"):
        optim.Adam().update(torch.zeros(1, 2), torch.zeros(1, 4), torch.zeros(1, 2), step=0)

"""The row-wise optimizer rules against the in-memory references they promise to match."""
import pytest
import torch

import float32_rules as rules
from conftest import TORCH_FUSES_MULTIPLY_ADD, rounding_tolerance
from mlkv_torch import optim

NUM, DIM, STEPS = 50, 8, 6


def bags(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, NUM, (40,), generator=g)
    ids[:6] = 3  # repeated ids: their gradients must be summed before the update
    offsets = torch.arange(0, 40, 4)
    target = torch.randn(10, DIM, generator=g)
    return ids, offsets, target


def run_rows(opt: optim.SparseOptimizer, initial: torch.Tensor, sparse: bool = False) -> torch.Tensor:
    """Our rule, fed the gradient rows of the batch's ids that nn.EmbeddingBag computes for the
    reference (the coalesced sparse gradient for SparseAdam, else the dense one): a reordered sum of
    a repeated id's gradient would differ in rounding, and this test is about the rule."""
    weights = initial.clone()
    state = opt.initial_state(NUM, DIM)
    for step in range(1, STEPS + 1):
        ids, offsets, target = bags(step)
        emb = torch.nn.EmbeddingBag(NUM, DIM, mode="sum", sparse=sparse, _weight=weights.clone())
        (emb(ids, offsets) * target).sum().backward()
        if sparse:
            grad = emb.weight.grad.coalesce()
            rows, grads = grad.indices()[0], grad.values()
        else:
            rows = ids.unique()
            grads = emb.weight.grad[rows]
        w, s = weights[rows], state[rows]
        opt.update(w, s, grads, step)
        weights[rows], state[rows] = w, s
    return weights


def run_reference(make_opt, initial: torch.Tensor) -> torch.Tensor:
    # SparseAdam takes sparse gradients; SGD and Adagrad the dense ones of torch's default (their
    # sparse paths round differently: no fused multiply-add).
    sparse = make_opt is SPARSE_ADAM
    emb = torch.nn.EmbeddingBag(NUM, DIM, mode="sum", sparse=sparse, _weight=initial.clone())
    opt = make_opt([emb.weight])
    for step in range(1, STEPS + 1):
        ids, offsets, target = bags(step)
        opt.zero_grad()
        (emb(ids, offsets) * target).sum().backward()
        opt.step()
    return emb.weight.detach()


def SPARSE_ADAM(params):
    return torch.optim.SparseAdam(params, lr=0.01, betas=(0.8, 0.99), eps=1e-8)


# The exact claim: each rule equals its float32 model (tests/helpers/float32_rules.py) to the bit, step after
# step, on every CPU; a rule off by 0.1% (its learning rate, say) fails here.
@pytest.mark.parametrize("ours, model", [
    (optim.SGD(lr=0.1), lambda w, s, g, t: rules.sgd(0.1, w, s, g, t)),
    (optim.Adagrad(lr=0.05, eps=0.1, initial_accumulator_value=0.1),
     lambda w, s, g, t: rules.adagrad(0.05, 0.1, w, s, g, t)),
    (optim.RowWiseAdagrad(lr=0.05, eps=1e-8), lambda w, s, g, t: rules.rowwise_adagrad(0.05, 1e-8, w, s, g, t)),
    (optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-8),
     lambda w, s, g, t: rules.adam(0.01, (0.8, 0.99), 1e-8, w, s, g, t)),
], ids=["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_rule_equals_its_float32_model(ours, model):
    g = torch.Generator().manual_seed(5)
    weights = torch.randn(NUM, DIM, generator=g)
    state = ours.initial_state(NUM, DIM)
    expected_weights, expected_state = weights.numpy().copy(), state.numpy().copy()
    for step in range(1, STEPS + 1):
        rows = torch.randperm(NUM, generator=g)[:20]
        grads = torch.randn(20, DIM, generator=g) * 3
        w, s = weights[rows], state[rows]
        ours.update(w, s, grads, step)
        weights[rows], state[rows] = w, s
        index = rows.numpy()
        expected_weights[index], expected_state[index] = model(expected_weights[index], expected_state[index],
                                                               grads.numpy(), step)
        torch.testing.assert_close(weights, torch.from_numpy(expected_weights), rtol=0, atol=0, msg=f"step {step}")
        torch.testing.assert_close(state, torch.from_numpy(expected_state), rtol=0, atol=0, msg=f"step {step}")


# Against torch's optimizers. step_bound None: the same operations, compared exactly (SGD's update is
# one fused multiply-add in torch's vectorized kernels; its scalar kernel, ATEN_CPU_CAPABILITY=default,
# rounds the product first). Else torch's CPU sqrt, which is not correctly rounded, makes a tolerance
# (conftest.rounding_tolerance) with the bound on a step over lr: SGD's gradients here are below 20,
# Adagrad's g / sqrt(sum g^2) <= 1, Adam's bias-corrected m / sqrt(v) <= (1 - beta1) / sqrt(1 - beta2) < 2.
@pytest.mark.parametrize("ours, reference, step_bound", [
    (optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1), None if TORCH_FUSES_MULTIPLY_ADD else 20.0),
    (optim.Adagrad(lr=0.1, eps=1e-10, initial_accumulator_value=0.1),
     lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10, initial_accumulator_value=0.1), 1.0),
    (optim.Adagrad(lr=0.05), lambda p: torch.optim.Adagrad(p, lr=0.05), 1.0),
    # an eps that counts beside sqrt(sum g^2): a rule that misplaced it would show
    (optim.Adagrad(lr=0.05, eps=0.1), lambda p: torch.optim.Adagrad(p, lr=0.05, eps=0.1), 1.0),
    (optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-8), SPARSE_ADAM, 2.0),
], ids=["sgd", "adagrad-init", "adagrad", "adagrad-eps", "adam"])
def test_rule_matches_torch_optimizer(ours, reference, step_bound):
    initial = torch.randn(NUM, DIM, generator=torch.Generator().manual_seed(0))
    tolerance = dict(rtol=0, atol=0) if step_bound is None else rounding_tolerance(STEPS, ours.lr, step_bound)
    torch.testing.assert_close(run_rows(ours, initial, sparse=reference is SPARSE_ADAM),
                               run_reference(reference, initial),
                               **tolerance)


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
    # fbgemm sums the squares in SIMD lanes (the order depends on the CPU's vector width); the step
    # over lr is at most sqrt(DIM)
    torch.testing.assert_close(run_rows(optim.RowWiseAdagrad(lr=lr, eps=eps), initial),
                               tbe.split_embedding_weights()[0].detach(), **rounding_tolerance(STEPS, lr, DIM ** 0.5))


def test_state_layout_and_validation():
    assert optim.SGD(lr=1).state_dim(16) == 0
    assert optim.Adagrad().state_dim(16) == 16
    assert optim.RowWiseAdagrad().state_dim(16) == 1
    assert optim.Adam().state_dim(16) == 32
    torch.testing.assert_close(optim.Adagrad(initial_accumulator_value=0.5).initial_state(2, 3),
                               torch.full((2, 3), 0.5), rtol=0, atol=0)
    with pytest.raises(ValueError, match="lr"):
        optim.SGD(lr=0)
    with pytest.raises(ValueError, match="betas"):
        optim.Adam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        optim.Adagrad(initial_accumulator_value=-1)
    with pytest.raises(ValueError, match="step"):
        optim.Adam().update(torch.zeros(1, 2), torch.zeros(1, 4), torch.zeros(1, 2), step=0)


@pytest.mark.parametrize("rule", [optim.SGD(lr=0.1), optim.Adagrad(lr=0.1), optim.RowWiseAdagrad(lr=0.1),
                                  optim.Adam(lr=0.1)], ids=lambda r: r.name)
def test_the_state_of_column_blocks_trained_apart_joins_into_the_whole_rows(rule):
    # Column-wise shards train each block of a row with its own state; joined, it is the state the
    # rule keeps for the whole row (row-wise Adagrad's mean over the row: within rounding).
    widths, rows = [4, 12], 3
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(rows, sum(widths), generator=generator) for _ in range(3)]
    whole = (torch.zeros(rows, sum(widths)), rule.initial_state(rows, sum(widths)))
    blocks = [(torch.zeros(rows, w), rule.initial_state(rows, w)) for w in widths]
    for step, grad in enumerate(grads, start=1):
        rule.update(*whole, grad, step)
        for (weights, state), block_grad in zip(blocks, grad.split(widths, dim=1)):
            rule.update(weights, state, block_grad.contiguous(), step)
    joined = rule.joined_state([state for _, state in blocks], widths)
    assert joined.shape == whole[1].shape
    if rule.name == "rowwise_adagrad":
        torch.testing.assert_close(joined, whole[1], rtol=4 * 2**-24 * len(grads), atol=0)
    else:
        assert torch.equal(joined, whole[1])

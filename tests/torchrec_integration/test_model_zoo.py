"""TorchRec's models with the one-line swap: DLRM, DLRM_DCN and DeepFM from ``torchrec.models``,
and a model whose two collections read one KeyedJaggedTensor. Each is built twice, with
EmbeddingBagCollection and with DiskEmbeddingBagCollection, and given the same weights through
the state dict; then the outputs and the training losses must agree at every step, fx tracing
must keep the model working, and a model built on the meta device must equal it once
materialised."""
import pytest
import torch

pytest.importorskip("torchrec")
from torch import nn  # noqa: E402
from torchrec.fx import symbolic_trace  # noqa: E402
from torchrec.models.deepfm import SimpleDeepFMNN  # noqa: E402
from torchrec.models.dlrm import DLRM, DLRM_DCN  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from conftest import TORCH_FUSES_MULTIPLY_ADD, rounding_tolerance  # noqa: E402
from mlkv_torch import optim  # noqa: E402
from mlkv_torch.torchrec import DiskEmbeddingBagCollection  # noqa: E402

DIM, DENSE, BATCH, LR = 8, 4, 6, 0.1
SIZES = {"user": 1000, "user_history": 1000, "item": 400, "context": 60}


def user_tables():
    return [EmbeddingBagConfig(name="t_user", num_embeddings=1000, embedding_dim=DIM,
                               feature_names=["user", "user_history"]),
            EmbeddingBagConfig(name="t_context", num_embeddings=60, embedding_dim=DIM, feature_names=["context"],
                               pooling=PoolingType.MEAN)]


def item_tables():
    return [EmbeddingBagConfig(name="t_item", num_embeddings=400, embedding_dim=DIM, feature_names=["item"])]


class TwoTower(nn.Module):
    """Two collections fed the same KJT, each taking the features its tables name."""

    def __init__(self, users: nn.Module, items: nn.Module) -> None:
        super().__init__()
        self.users, self.items = users, items
        self.dense = nn.Linear(DENSE, 1)
        self.user_proj = nn.Linear(3 * DIM, DIM)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        user = self.user_proj(self.users(sparse).values())
        item = self.items(sparse).values()
        return (user * item).sum(dim=1, keepdim=True) + self.dense(dense)


def build(model: str, collection) -> nn.Module:
    """`model` over collections made by `collection(configs, name)`."""
    every = user_tables() + item_tables()
    if model == "dlrm":
        return DLRM(embedding_bag_collection=collection(every, "all"), dense_in_features=DENSE,
                    dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])
    if model == "dlrm_dcn":
        return DLRM_DCN(embedding_bag_collection=collection(every, "all"), dense_in_features=DENSE,
                        dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1], dcn_num_layers=2,
                        dcn_low_rank_dim=4)
    if model == "deepfm":
        return SimpleDeepFMNN(num_dense_features=DENSE, embedding_bag_collection=collection(every, "all"),
                              hidden_layer_size=16, deep_fm_dimension=4)
    return TwoTower(collection(user_tables(), "users"), collection(item_tables(), "items"))


MODELS = ["dlrm", "dlrm_dcn", "deepfm", "two_tower"]


def stock(configs, name):
    return EmbeddingBagCollection(configs)


def on_disk(root, device=None):
    def make(configs, name):
        # Fewer cached rows than the tables have: training evicts, writes back and reads again.
        return DiskEmbeddingBagCollection(configs, device=device, path=root / name, optimizer=optim.SGD(lr=LR),
                                          memory_budget_bytes=1 << 20, cache_rows=150, seed=0)
    return make


def batch(step):
    g = torch.Generator().manual_seed(step)
    keys = list(SIZES)
    lengths = torch.randint(0, 4, (len(keys), BATCH), generator=g)
    values = torch.cat([torch.randint(0, SIZES[k], (int(lengths[i].sum()),), generator=g) for i, k in enumerate(keys)])
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths.flatten())
    return torch.randn(BATCH, DENSE, generator=g), sparse, torch.randint(0, 2, (BATCH,), generator=g).float()


def pair(model, tmp_path):
    """The stock model and its disk twin, with the stock model's weights."""
    torch.manual_seed(0)
    reference = build(model, stock)
    ours = build(model, on_disk(tmp_path))
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def dense_parameters(model):
    # The tables train in their own fused optimizer; their parameters are zero-size anchors.
    return [p for name, p in model.named_parameters() if ".embedding_bags." not in f".{name}"]


@pytest.mark.parametrize("model", MODELS)
def test_same_weights_give_the_same_outputs_and_training_losses(tmp_path, model):
    reference, ours = pair(model, tmp_path)
    assert set(ours.state_dict()) == set(reference.state_dict())
    opt_ref = torch.optim.SGD(reference.parameters(), lr=LR)
    opt = torch.optim.SGD(dense_parameters(ours), lr=LR)
    loss_fn = nn.BCEWithLogitsLoss()
    # The same arithmetic where torch's SGD is a fused multiply-add as ours; its scalar kernel
    # (ATEN_CPU_CAPABILITY=default) rounds the product first (conftest.rounding_tolerance; the tables'
    # gradients here are below 1).
    tolerance = dict(rtol=0, atol=0) if TORCH_FUSES_MULTIPLY_ADD else rounding_tolerance(20, LR, 1.0)
    for step in range(20):
        dense, sparse, labels = batch(step % 7)  # batches come back: rows trained earlier are read again
        outputs, losses = [], []
        for m, o in ((reference, opt_ref), (ours, opt)):
            o.zero_grad()
            out = m(dense, sparse)
            loss = loss_fn(out.squeeze(1), labels)
            loss.backward()
            o.step()
            outputs.append(out.detach())
            losses.append(loss.detach())
        torch.testing.assert_close(outputs[1], outputs[0], **tolerance, msg=f"{model}, step {step}: outputs")
        torch.testing.assert_close(losses[1], losses[0], **tolerance, msg=f"{model}, step {step}: loss")
    trained = reference.state_dict()
    for key, value in ours.state_dict().items():  # the tables' rows too, read back from disk
        torch.testing.assert_close(value, trained[key], **tolerance, msg=key)


@pytest.mark.parametrize("model", MODELS)
def test_symbolic_tracing_keeps_the_model_working(tmp_path, model):
    reference, ours = pair(model, tmp_path)
    traced = symbolic_trace(ours)
    calls = {n.target for n in traced.graph.nodes if n.op == "call_module"}
    disk_modules = {name for name, m in ours.named_modules() if isinstance(m, DiskEmbeddingBagCollection)}
    assert disk_modules <= calls  # each collection is one call: its data-dependent work stays out of the graph
    opt_ref = torch.optim.SGD(reference.parameters(), lr=LR)
    opt = torch.optim.SGD(dense_parameters(traced), lr=LR)
    for step in range(3):
        dense, sparse, labels = batch(step)
        losses = []
        for m, o in ((reference, opt_ref), (traced, opt)):
            o.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(m(dense, sparse).squeeze(1), labels)
            loss.backward()
            o.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0, msg=f"{model}, step {step}")


@pytest.mark.parametrize("model", MODELS)
def test_built_on_the_meta_device_it_equals_the_model_once_materialised(tmp_path, model):
    torch.manual_seed(0)
    reference = build(model, stock)
    ours = build(model, on_disk(tmp_path, device=torch.device("meta")))
    assert not any(p.is_meta for p in dense_parameters(ours))  # the dense layers are built where asked
    assert not list(tmp_path.iterdir())  # no table opened yet
    for module in ours.modules():  # what is on meta (as DMP materialises): the model's own buffers stay
        if isinstance(module, DiskEmbeddingBagCollection):
            module.to_empty(device="cpu")
    ours.load_state_dict(reference.state_dict())
    for step in range(2):
        dense, sparse, _ = batch(step)
        torch.testing.assert_close(ours(dense, sparse), reference(dense, sparse), rtol=0, atol=0)

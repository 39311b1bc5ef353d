"""BatchNorm statistics recomputed before evaluation (pipeline.train.precise_bn, ``train.precise_bn_batches``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pipeline.train.batching import NodeBudgetSampler
from pipeline.train.precise_bn import StatisticsBatches, batchnorm_layers, recompute_batchnorm_stats


class DropoutThenNorm(nn.Module):
    """A residual sum with dropout right before BatchNorm, as SAT's post-norm layers have it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.norm = nn.BatchNorm1d(4)
        self.seen: list[torch.Tensor] = []  # what the norm layer received, in order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.drop(self.lin(x))
        self.seen.append(h.detach().clone())
        return self.norm(h)


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 4, generator=g) * 3 + 1 for _ in range(n)]


def test_statistics_are_the_average_over_the_batches_with_dropout_off():
    torch.manual_seed(0)
    model = DropoutThenNorm()
    model.train()
    for batch in _batches(20, seed=1):  # moving averages of training, dropout on
        model(batch)
    model.norm.momentum = 0.25
    model.seen.clear()
    batches = _batches(5, seed=2)
    assert recompute_batchnorm_stats(model, batches, model) is not None and len(model.seen) == 5
    # the inputs the norm saw were dropout-free: x + lin(x)
    with torch.no_grad():
        for seen, batch in zip(model.seen, batches):
            assert torch.allclose(seen, batch + model.lin(batch), atol=1e-6)
    mean = torch.stack([s.mean(0) for s in model.seen]).mean(0)
    var = torch.stack([s.var(0, unbiased=True) for s in model.seen]).mean(0)
    assert torch.allclose(model.norm.running_mean, mean, atol=1e-5)
    assert torch.allclose(model.norm.running_var, var, rtol=1e-5)
    # modes and momentum as they were
    assert model.training and model.drop.training and model.norm.training
    assert model.norm.momentum == 0.25


def test_the_shift_shows_dropouts_inflated_variance_and_a_moved_mean():
    """Li et al.'s variance shift: with dropout 0.5 in front of the norm, the variance training saw
    is larger than the dropout-free one (ratio well above 1); without dropout the moving averages
    over the same distribution agree with the recomputed statistics. Shifted inputs move the mean."""
    def shift_after_training(p: float, offset: float = 0.0):
        torch.manual_seed(0)
        model = DropoutThenNorm()
        model.drop.p = p
        with torch.no_grad():
            model.lin.weight.copy_(torch.eye(4) * 2)  # the dropped term dominates the sum
            model.lin.bias.zero_()
        model.train()
        for batch in _batches(60, seed=1):
            model(batch)
        return recompute_batchnorm_stats(model, [b + offset for b in _batches(20, seed=2)], model)

    dropout = shift_after_training(0.5)
    # per channel h = x (1 + 2 m / (1 - p)), m ~ Bernoulli(1 - p), x of mean 1 and variance 9: in
    # training Var(h) = E[x^2] E[a^2] - (E[x] E[a])^2 with a = 1 + 4 m: 10 * 13 - 9 = 121; without
    # dropout h = 3 x, Var(h) = 81
    assert dropout.var_ratio == pytest.approx(121 / 81, rel=0.2)  # the moving average of ~20 batches is noisy
    assert dropout.worst_layer_var_ratio == pytest.approx(dropout.var_ratio)  # one layer
    plain = shift_after_training(0.0)
    assert plain.var_ratio == pytest.approx(1.0, abs=0.1)
    assert plain.mean_shift < 0.2
    moved = shift_after_training(0.0, offset=3.0)  # h = 3 x moves by 9: one standard deviation of h
    assert moved.mean_shift == pytest.approx(1.0, abs=0.2)
    assert moved.var_ratio == pytest.approx(1.0, abs=0.1)


def test_no_batches_leaves_the_statistics_and_a_model_without_batchnorm_is_untouched():
    model = DropoutThenNorm()
    model.train()
    for batch in _batches(3):
        model(batch)
    before = (model.norm.running_mean.clone(), model.norm.running_var.clone(), int(model.norm.num_batches_tracked))
    model.eval()
    assert recompute_batchnorm_stats(model, [], model) is None
    assert torch.equal(model.norm.running_mean, before[0]) and torch.equal(model.norm.running_var, before[1])
    assert int(model.norm.num_batches_tracked) == before[2] and not model.training

    plain = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert batchnorm_layers(plain) == []
    assert recompute_batchnorm_stats(plain, _batches(2), plain) is None


def test_sat_in_evaluation_with_recomputed_statistics_normalises_as_training_did_without_dropout():
    """Recomputed over one batch, the statistics are that batch's own: SAT's evaluation output on it
    equals its training-mode output with dropout off (BatchNorm on batch statistics), once the
    unbiased variance BatchNorm keeps is scaled back to the batch's own, (n - 1) / n over its n nodes."""
    from sat import SAT, SATConfig
    from sat.data import SATData
    from torch_geometric.data import Batch

    torch.manual_seed(0)
    config = SATConfig(hidden_dim=16, num_layers=2, num_heads=2, dropout=0.3, attention="dense", extractor="subtree",
                       k_hops=1, gnn_type="gcn", use_edge_attr=False, pe="none", pe_dim=0, node_encoder="embedding",
                       node_in_dim=3, edge_encoder="none", head="node_classification", num_classes=2)
    model = SAT(config)
    graphs = []
    for i in range(6):
        n = 20 + 5 * i
        src = torch.randint(0, n, (3 * n,))
        dst = torch.randint(0, n, (3 * n,))
        ei = torch.cat([torch.stack([src, dst]), torch.stack([dst, src])], 1)
        graphs.append(SATData(x=torch.randint(0, 3, (n, 1)), edge_index=ei, num_nodes=n))
    batch = Batch.from_data_list(graphs)
    model.train()
    for _ in range(3):
        model(batch)  # moving averages with dropout on
    with torch.no_grad():
        model.eval()
        stale = model(batch)
        assert recompute_batchnorm_stats(model, [batch], model) is not None
        n = batch.num_nodes
        for m in batchnorm_layers(model):  # every norm layer of the k-subtree SAT runs over the nodes
            m.running_var.mul_((n - 1) / n)
        recomputed = model(batch)
        for m in model.modules():  # batch statistics, dropout off
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()
        reference = model(batch)
    assert torch.allclose(recomputed, reference, atol=1e-4), (recomputed - reference).abs().max()
    # and that is a real change from the stale moving averages
    assert (stale - reference).abs().max() > 1e-2


def test_statistics_batches_are_the_first_of_a_shuffled_pass_of_their_own():
    sizes = np.full(100, 10)
    sampler = NodeBudgetSampler(sizes, 50, shuffle=True, seed=7, bucket_size=100, max_graphs=5)
    chosen = StatisticsBatches(sampler, 3)
    assert len(chosen) == 3
    chosen.set_epoch(0)
    first = [b.tolist() for b in chosen]
    assert first == [b.tolist() for b in sampler.epoch_batches(0)[:3]]
    chosen.set_epoch(1)
    assert [b.tolist() for b in chosen] != first  # fresh batches after every epoch
    assert len(StatisticsBatches(sampler, 1000)) == len(sampler)


def test_the_job_setting_is_validated():
    from pipeline.config.train import TrainConfig

    assert TrainConfig().precise_bn_batches == 0
    assert TrainConfig(precise_bn_batches=32).precise_bn_batches == 32
    with pytest.raises(ValueError, match="precise_bn_batches"):
        TrainConfig(precise_bn_batches=-1)


def _rank_statistics(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from pipeline.train.precise_bn import recompute_batchnorm_stats

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = DropoutThenNorm()
        with torch.no_grad():
            model.lin.weight.zero_()
            model.lin.bias.zero_()  # the norm sees the batch itself
        batch = torch.full((8, 4), float(rank)) + torch.arange(8.0).view(-1, 1) * (rank + 1)
        recompute_batchnorm_stats(model, [batch], model)
        torch.save({"mean": model.norm.running_mean, "var": model.norm.running_var}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ranks_evaluate_with_the_average_of_their_statistics(tmp_path):
    """Over several ranks (torch.distributed, gloo as on CPU workers), every rank ends with the
    mean of the ranks' recomputed statistics."""
    import torch.multiprocessing as mp

    mp.start_processes(_rank_statistics, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    rows = torch.arange(8.0)
    means = [torch.full((4,), float(r) + rows.mean().item() * (r + 1)) for r in range(2)]
    variances = [torch.full((4,), rows.var().item() * (r + 1) ** 2) for r in range(2)]
    for g in got:
        assert torch.allclose(g["mean"], (means[0] + means[1]) / 2, atol=1e-5)
        assert torch.allclose(g["var"], (variances[0] + variances[1]) / 2, rtol=1e-5)

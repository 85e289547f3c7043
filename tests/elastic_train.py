"""An elastic Horovod job for ``tests/test_elastic.py``: dist-EF-blockSGDM trains under
``hvd.elastic.run`` with the given exchange (its server sharded among the ranks, or among
the nodes) through a sequence of world changes: at each change's step rank 0 rewrites the
host-discovery file to that change's hosts (separated by commas), so workers leave or join.
At each reset every worker writes what it saw to ``<dir>/change<k>_rank<r>.pt``; the workers
that finish write ``<dir>/rank<r>.pt``.

    horovodrun -np 3 --min-np 2 --host-discovery-script <dir>/discover.sh \\
        python -m tests.elastic_train <dir> <steps> <exchange> 4=localhost:2 8=localhost:3
"""

import os
import sys

import horovod.torch as hvd
import torch

import hvd_compress.pt as hc

from .elastic_changes import change_hosts
from .pt_jobs import Net, random_batch


def _server_mass(pipeline, plan, server):
    """Where this rank's ``server`` residual of ``plan``'s tensor reaches the average, and
    its share of it: a sharded server's shard whole, a replicated one over its ranks."""
    exchange, numel, ranks, rank = pipeline.server_exchange(plan)
    if exchange != "sharded":
        return slice(0, numel), server / ranks
    return hc.exchange.make_exchange(
        "sharded", pipeline.codec, numel, ranks, pipeline.meter, 1
    ).shard(rank), server


def parameter_mass(pipeline):
    """This rank's share of the residual mass, as the average of a step would carry it:
    its worker residual over the ranks that average it (all N, or for a two-level tensor's
    shard the M nodes), plus its share of the server residual, each at its positions."""
    mass = {}
    for plan in pipeline.plans.values():
        if plan.reason != "compressed":
            continue
        positions, numel, ranks = slice(0, plan.numel), plan.numel, pipeline.world_size
        if plan.exchange == "two-level":
            _, shard = pipeline.nodes.locate(pipeline.rank)
            numel = pipeline.nodes.shard_length(plan.numel)
            positions, ranks = slice(shard * numel, (shard + 1) * numel), pipeline.nodes.cross_size
        total = pipeline.state.worker.residuals.get(plan.name, torch.zeros(numel)) / ranks
        server = pipeline.state.server.residuals.get(plan.name)
        if server is not None:
            where, share = _server_mass(pipeline, plan, server)
            total = total.clone()
            total[where] += share
        whole = torch.zeros(pipeline.nodes.local_size * numel if pipeline.nodes else numel)
        whole[positions] = total
        mass[plan.name] = whole[: plan.numel]
    return mass


def main(directory, steps, exchange, changes):
    """``changes``: (step, hosts) pairs in step order."""
    hvd.init(process_sets="dynamic")
    torch.manual_seed(0)
    model = Net()
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model.named_parameters(),
        compression=hc.BlockSign(min_size=0),
        exchange=exchange,
    )
    pipeline = optimizer._hvdc_pipeline
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    change_steps = [step for step, _ in changes]
    sizes = []
    committed = {}

    def on_reset():
        # The world changed at the step the state was rolled back to: the mass this rank held
        # at that commit, and after the pipeline adapted to the new world.
        pipeline._follow_world()
        seen = {
            "before": committed["mass"],
            "after": parameter_mass(pipeline),
            "world": pipeline.world_size,
            "nodes": pipeline.nodes and pipeline.nodes.node_sets(),
        }
        change = change_steps.index(state.step)
        torch.save(seen, os.path.join(directory, f"change{change}_rank{hvd.rank()}.pt"))

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            data = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            optimizer.zero_grad()
            x, y = random_batch(data)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            state.step += 1
            sizes.append(hvd.size())
            committed["mass"] = parameter_mass(pipeline)
            state.commit()
            if state.step in change_steps:
                hosts = changes[change_steps.index(state.step)][1]
                change_hosts(state, hvd.rank(), directory, hosts)

    train(state)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(
        {
            "sizes": sizes,
            "params": params,
            "size": hvd.size(),
            "nodes": pipeline.nodes and pipeline.nodes.node_sets(),
            "residuals": sorted(pipeline.state.worker.residuals),
        },
        os.path.join(directory, f"rank{hvd.rank()}.pt"),
    )


if __name__ == "__main__":
    changes = [argument.split("=", 1) for argument in sys.argv[4:]]
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], [(int(s), h) for s, h in changes])

"""An elastic Horovod job for ``tests/test_elastic.py``: dist-EF-blockSGDM with a sharded server
trains under ``hvd.elastic.run``; at ``shrink_at`` rank 0 rewrites the host-discovery file from
3 slots to 2, so one worker leaves. Each process writes what it saw to ``<dir>/rank<r>.pt``.

    horovodrun -np 3 --min-np 2 --host-discovery-script <dir>/discover.sh \\
        python -m tests.elastic_train <dir> <steps> <shrink_at>
"""

import os
import sys
import time

import horovod.torch as hvd
import torch

import hvd_compress.pt as hc

from .test_pt_distributed import Net


def _mass(pipeline):
    """This rank's share of the residual mass: its worker residual over N, plus the part of
    the server residual it holds (its shard, in the sharded exchange)."""
    mass = {}
    for plan in pipeline.plans.values():
        if plan.reason != "compressed":
            continue
        total = (
            pipeline.worker_memory.residuals.get(plan.name, torch.zeros(plan.numel))
            / pipeline.world_size
        )
        server = pipeline.server_memory.residuals.get(plan.name)
        if server is not None:
            shard = hc.exchange.make_exchange(
                "sharded", pipeline.codec, plan.numel, pipeline.world_size, pipeline.meter, 1
            ).shard(pipeline.rank)
            total = total.clone()
            total[shard] += server
        mass[plan.name] = total
    return mass


def main(directory, steps, shrink_at):
    hvd.init()
    torch.manual_seed(0)
    model = Net()
    optimizer = hc.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model.named_parameters(),
        compression=hc.BlockSign(min_size=0),
        exchange="sharded",
    )
    pipeline = optimizer._hvdc_pipeline
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)
    seen = {"sizes": [], "before": None, "after": None}
    committed = {}

    def on_reset():
        # The world changed: the mass this rank held at the last commit, and after the
        # pipeline adapted to the new world.
        seen["before"] = committed["mass"]
        pipeline._follow_world()
        seen["after"] = _mass(pipeline)
        seen["after_world"] = pipeline.world_size

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            data = torch.Generator().manual_seed(1000 * state.step + hvd.rank())
            optimizer.zero_grad()
            x = torch.randn(8, 64, generator=data)
            torch.nn.functional.cross_entropy(
                model(x), torch.randint(0, 10, (8,), generator=data)
            ).backward()
            optimizer.step()
            state.step += 1
            seen["sizes"].append(hvd.size())
            committed["mass"] = _mass(pipeline)
            state.commit()
            if state.step == shrink_at:
                if hvd.rank() == 0:
                    with open(os.path.join(directory, "hosts"), "w") as f:
                        f.write("localhost:2\n")
                # Wait for the driver to see the new hosts (it polls the discovery script),
                # so the shrink happens at this step however loaded the machine is; every
                # rank takes part in each check, and all are interrupted together.
                for _ in range(600):
                    time.sleep(0.5)
                    state.check_host_updates()

    train(state)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(
        {"seen": seen, "params": params, "size": hvd.size()},
        os.path.join(directory, f"rank{hvd.rank()}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

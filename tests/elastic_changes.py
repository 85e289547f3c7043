"""A change of world in the elastic jobs of ``tests/test_elastic.py``
(``tests/elastic_train.py``, ``tests/elastic_train_keras.py``)."""

import os
import time


def change_hosts(state, rank, directory, hosts):
    """Rank 0 writes ``hosts`` (separated by commas) to the host-discovery file in
    ``directory``; every rank then waits for the driver to see them (it polls the discovery
    script), so that the change happens at this step however loaded the machine is: each
    rank takes part in each check, and all are interrupted together (``state`` raises)."""
    if rank == 0:
        with open(os.path.join(directory, "hosts"), "w") as f:
            f.write(hosts.replace(",", "\n") + "\n")
    for _ in range(600):
        time.sleep(0.5)
        state.check_host_updates()

"""The demo application, apart from the library: the example scripts (MNIST-1D CNNs and GRU,
a byte-level transformer LM), their data (``datasets``, ``corpus``), arguments (``args``) and
results (``report``), and the ``hvd-compress`` command (``cli``). Shipped with the wheel so
that ``hvd-compress demo`` runs from it."""

"""The MNIST-1D example scripts, shipped so that ``hvd-compress demo`` runs from a wheel."""

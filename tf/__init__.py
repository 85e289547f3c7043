"""TensorFlow port of hvd_compress (to come: it will mirror ``hvd_compress.pt`` file for file)."""

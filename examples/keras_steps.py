"""The Keras examples' record of a run: every step's time and compression statistics."""

import time

import keras

from hvd_compress.examples.report import RunRecord


class StepRecorder(keras.callbacks.Callback):
    """Times every step and records the compression statistics of its exchange."""

    def __init__(self):
        super().__init__()
        self.record = RunRecord()

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.record.record(
            time.perf_counter() - self.start, self.model.optimizer.compression_stats()
        )

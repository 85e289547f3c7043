"""Horovod's wrapper keywords that hvd_compress takes at their default only, each with
another value: what the refusal tests of both ports pass (``test_validation``,
``test_tf_keras``)."""

NOT_DEFAULT = {
    "num_groups": 2,
    "groups": [[]],
    "device_dense": "/gpu:0",
    "device_sparse": "/cpu:0",
    "name": "mine",
}

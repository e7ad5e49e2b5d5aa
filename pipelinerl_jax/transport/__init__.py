"""Transport: the gRPC rollout queue (samplers → learner) and versioned weight sync
(learner → engines). Schema: `rollout.proto`; design and semantics: docs/transport.md.

Learner loop, in order (why: a rollout may never carry a version the queue has not heard of):
    batch = queue.get_batch(num_groups, timeout_s, learner_version=v)
    ... train → version v+1 ...
    queue.set_version(v + 1); publisher.publish(v + 1, flat_params)
    ... after the checkpoint holding the step is saved: queue.ack([batch.batch_id, ...])

Names are imported lazily (PEP 562), so `python -m pipelinerl_jax.transport.queue_server`
runs its module once and `import pipelinerl_jax.transport` stays cheap.
"""
import importlib

_EXPORTS = {
    "codec": ["InvalidRollout", "Limits", "rollout_from_pb", "rollout_to_pb"],
    "transport_section": ["client_kwargs", "publisher_kwargs", "queue_address", "subscriber_kwargs",
                          "transport_config", "validate_transport_config", "weights_address"],
    "queue_client": ["Batch", "PutResult", "QueueUnavailable", "RolloutQueueClient",
                     "RolloutRejected", "SessionSupersededError", "TransportError"],
    "queue_server": ["RolloutQueueServer"],
    "retry": ["RetryPolicy"],
    "security": ["TLSConfig"],
    "versioned_dir": ["gc_versions", "latest_version", "list_versions", "write_versioned_dir"],
    "weights": ["WeightPublisher", "WeightSubscriber"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__

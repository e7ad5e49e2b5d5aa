"""Transport: the gRPC rollout queue (samplers → learner) and versioned weight sync
(learner → engines). Schema: `rollout.proto`; design and semantics: docs/transport.md.

Learner loop, in order (why: a rollout may never carry a version the queue has not heard of):
    batch = queue.get_batch(num_groups, timeout_s, learner_version=v)
    ... train → version v+1 ...
    queue.set_version(v + 1); publisher.publish(v + 1, flat_params)
    ... after the checkpoint holding the step is saved: queue.ack([batch.batch_id, ...])
"""
from pipelinerl_jax.transport.codec import InvalidRollout, Limits, rollout_from_pb, rollout_to_pb
from pipelinerl_jax.transport.config import (
    client_kwargs, queue_address, transport_config, validate_transport_config, weights_address)
from pipelinerl_jax.transport.queue_client import (
    Batch, PutResult, QueueUnavailable, RetryPolicy, RolloutQueueClient, RolloutRejected,
    SessionSupersededError, TransportError)
from pipelinerl_jax.transport.queue_server import RolloutQueueServer
from pipelinerl_jax.transport.security import TLSConfig
from pipelinerl_jax.transport.versioned_dir import (
    gc_versions, latest_version, list_versions, write_versioned_dir)
from pipelinerl_jax.transport.weights import WeightPublisher, WeightSubscriber

__all__ = [
    "Batch", "InvalidRollout", "Limits", "PutResult", "QueueUnavailable", "RetryPolicy",
    "RolloutQueueClient", "RolloutQueueServer", "RolloutRejected", "SessionSupersededError",
    "TLSConfig", "TransportError", "WeightPublisher", "WeightSubscriber", "client_kwargs",
    "gc_versions", "latest_version", "list_versions", "queue_address", "rollout_from_pb",
    "rollout_to_pb", "transport_config", "validate_transport_config", "weights_address",
    "write_versioned_dir",
]

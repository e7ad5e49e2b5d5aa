"""The weight stream spoken in flat terms, for the transport's own tests: a publisher taking
`(version, {name: array}, policy_version)` and a subscriber whose callback gets
`(version, arrays or path, policy version)`. Both send and receive real `WeightVersion`
messages of kind 'full' underneath; tests of the message itself (kinds, bases, refusals)
use `WeightPublisher` / `WeightSubscriber` directly."""
from pipelinerl_jax.transport.weight_version import WeightVersion
from pipelinerl_jax.transport.weights import WeightPublisher, WeightSubscriber

FULL = WeightVersion("full")


class FlatPublisher(WeightPublisher):
    def publish(self, version, params=None, policy_version=None):
        if isinstance(version, WeightVersion):
            return super().publish(version)
        return super().publish(FULL.carrying(version, tensors=params,
                                             policy_version=policy_version))

    def publish_dir(self, version, path, policy_version=None):
        return super().publish(FULL.carrying(version, path=path, policy_version=policy_version))


def FlatSubscriber(address, on_weights, *args, **kw):  # noqa: N802 - stands for a class
    return WeightSubscriber(address, lambda m: on_weights(
        m.version, m.path if m.path is not None else m.tensors, m.policy), *args, **kw)

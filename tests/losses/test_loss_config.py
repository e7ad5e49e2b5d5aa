"""The registry's validation and the `loss` config section, including real absl flag overrides
through ml_collections.config_flags with a locked config."""
import textwrap

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from losses_testlib import make_inputs, run_many
from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.losses import (LOSSES, advantage_config, get_loss, hparams_of, loss_config,
                                   loss_from_config, needs_proximal, validate_loss_config)


def test_unknown_loss_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"^loss.name: unknown loss 'tiss'") as e:
        get_loss("tiss")
    assert e.value.key == "loss.name"
    for name in LOSSES:
        assert name in str(e.value)


def test_unknown_hyperparameter_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"^loss.cap: is not a hyperparameter of loss 'ppo'") as e:
        get_loss("ppo", cap=2.0)
    assert "'dual_clip'" in str(e.value) and "'eps_high'" in str(e.value)
    with pytest.raises(ConfigError, match="^loss.agg: is not a hyperparameter of loss 'gspo'"):
        get_loss("gspo", agg="token_mean")


@pytest.mark.parametrize("name,hparams,key", [
    ("ppo", {"eps_low": 1.0}, "loss.eps_low"),
    ("ppo", {"eps_high": -0.1}, "loss.eps_high"),
    ("ppo", {"dual_clip": 1.0}, "loss.dual_clip"),
    ("ppo", {"eps_low": True}, "loss.eps_low"),
    ("ppo", {"eps_low": float("nan")}, "loss.eps_low"),
    ("tis", {"cap": 0.0}, "loss.cap"),
    ("tis", {"level": "row"}, "loss.level"),
    ("tis", {"cap": None}, "loss.cap"),
    ("decoupled_ppo", {"behave_cap": -1.0}, "loss.behave_cap"),
    ("icepop", {"band_low": 1.5}, "loss.band_low"),
    ("icepop", {"band_high": 0.9}, "loss.band_high"),
    ("staleness_clip", {"schedule": "linear"}, "loss.schedule"),
    ("staleness_clip", {"schedule": "exp", "alpha": 2.0}, "loss.alpha"),
    ("staleness_clip", {"lag_cutoff": 2.5}, "loss.lag_cutoff"),
    ("staleness_clip", {"lag_cutoff": -1}, "loss.lag_cutoff"),
    ("staleness_clip", {"cap": 0.9}, "loss.cap"),
    ("staleness_clip", {"max_lag": 4}, "loss.max_lag"),  # renamed lag_cutoff: refused by name
    ("cispo", {"eps_low": 1.2}, "loss.eps_low"),
    ("m2po", {"tau": 0.0}, "loss.tau"),
    ("m2po", {"form": "code"}, "loss.form"),
    ("m2po", {"floor_low": 1.5}, "loss.floor_low"),
    ("reinforce", {"agg": "mean"}, "loss.agg"),
    ("reinforce", {"agg": "constant"}, "loss.max_tokens"),
    ("reinforce", {"max_tokens": 128}, "loss.max_tokens"),
    ("reinforce", {"agg": "constant", "max_tokens": 0}, "loss.max_tokens"),
    ("reinforce", {"kl_coef": -1.0}, "loss.kl_coef"),
    ("reinforce", {"kl_estimator": "k4"}, "loss.kl_estimator"),
])
def test_invalid_values_fail_at_construction_naming_the_key(name, hparams, key):
    with pytest.raises(ConfigError) as e:
        get_loss(name, **hparams)
    assert e.value.key == key and str(e.value).startswith(key + ": ")


def test_defaults_are_the_spec():
    assert get_loss("ppo").hparams == {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None,
                                       "agg": "token_mean", "max_tokens": None,
                                       "kl_coef": 0.0, "kl_estimator": "k3"}
    assert get_loss("tis").hparams["cap"] == 2.0 and get_loss("tis").hparams["level"] == "token"
    assert get_loss("cispo").hparams["eps_low"] is None
    assert get_loss("cispo").hparams["eps_high"] == 5.0
    assert get_loss("gspo").hparams == {"eps_low": 3e-4, "eps_high": 4e-4, "kl_coef": 0.0,
                                        "kl_estimator": "k3"}
    assert get_loss("m2po").hparams["tau"] == 0.04
    staleness = get_loss("staleness_clip").hparams
    assert (staleness["cap"], staleness["schedule"], staleness["alpha"],
            staleness["lag_cutoff"]) == (2.0, "inverse", 0.5, None)
    m2po = get_loss("m2po").hparams
    # no floor, as the authors' training scripts run the released form
    assert (m2po["form"], m2po["floor_low"], m2po["floor_high"]) == ("paper", None, None)
    icepop = get_loss("icepop").hparams
    assert (icepop["band_low"], icepop["band_high"]) == (0.5, 5.0)


def test_config_section_builds_every_loss_with_its_defaults():
    cfg = loss_config()
    assert cfg.name == "reinforce" and cfg.kl_coef == 0.0 and cfg.kl_estimator == "k3"
    for name in LOSSES:
        for key in hparams_of(name):
            assert key in cfg, key
        cfg.name = name
        assert loss_from_config(cfg).hparams == get_loss(name).hparams


def test_a_loss_needs_the_proximal_policy_exactly_when_it_weighs_both_old_policies():
    """Decoupled objectives (DESIGN.md) take the proximal ratio and the behaviour weight:
    given a proximal policy, their value moves with both `logp_proximal` and
    `logp_behaviour`. Every other loss reads at most one of them, so the learner's proximal
    recompute ('auto') would be wasted on it. Checked on the losses' outputs, for every
    registered loss, not against a list of names."""
    names = sorted(LOSSES)
    base = make_inputs(seed=5)
    moved = [base, dict(base, logp_proximal=base["logp_proximal"] + 0.3),
             dict(base, logp_behaviour=base["logp_behaviour"] - 0.3)]
    losses = [[loss for loss, _ in run_many([(n, {}) for n in names], x)] for x in moved]
    uses_both = {n for n, l0, lp, lm in zip(names, *losses)
                 if not np.isclose(l0, lp, rtol=1e-6) and not np.isclose(l0, lm, rtol=1e-6)}
    assert uses_both and uses_both != set(names)
    assert uses_both == {name for name in LOSSES if needs_proximal(name)}
    for name in LOSSES:
        assert get_loss(name).needs_proximal is needs_proximal(name)
    with pytest.raises(ConfigError, match="^loss.name: unknown loss 'tiss'"):
        needs_proximal("tiss")


def test_the_staleness_ablation_runs_every_registered_loss_with_its_defaults():
    """A loss added to the registry joins the grid as an arm of its own name with its
    defaults (plus m2po's released form, with and without its floor) unless the grid lists it
    as outside, so every arm builds a distinct loss."""
    from configs.ablate import staleness
    c = staleness.get_config()
    arms = {label: c.axes.loss.levels[label].loss for label in c.axes.loss.order}
    in_grid = set(LOSSES) - set(staleness.OUTSIDE_GRID)
    assert {"vcpo", "seq_is"} <= in_grid and not set(staleness.OUTSIDE_GRID) & set(arms)
    assert in_grid <= set(arms)
    assert all(arms[n].to_dict() == {"name": n} for n in in_grid)
    # m2po's released form twice: as the authors' scripts run it, and with the clip floor
    assert arms["m2po_authors"].to_dict() == {"name": "m2po", "form": "released"}
    assert arms["m2po_released"].to_dict() == {"name": "m2po", "form": "released",
                                               "floor_low": 0.3, "floor_high": 0.5}
    built = [tuple(sorted(get_loss(**a.to_dict()).hparams.items())) + (a.name,)
             for a in arms.values()]
    assert len(set(built)) == len(built)


def test_config_hyperparameter_of_another_loss_fails_naming_it():
    cfg = loss_config()
    cfg.name, cfg.cap = "ppo", 2.0
    with pytest.raises(ConfigError, match=r"^loss.cap: .*'eps_low'"):
        loss_from_config(cfg)
    with pytest.raises(ConfigError, match="^loss.cap"):
        validate_loss_config(cfg)
    cfg.name = "tis"
    assert validate_loss_config(cfg)["cap"] == 2.0


def test_a_plain_dict_section_rejects_typos():
    with pytest.raises(ConfigError, match="^loss.capp: unknown key"):
        validate_loss_config({"name": "tis", "capp": 2.0})
    with pytest.raises(ConfigError, match="^loss.name"):
        validate_loss_config({"cap": 2.0})


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "exp_config.py"
    path.write_text(textwrap.dedent("""
        import ml_collections
        from pipelinerl_jax.losses import advantage_config, loss_config

        def get_config():
            config = ml_collections.ConfigDict()
            config.loss = loss_config()
            config.advantage = advantage_config()
            return config
    """))
    return str(path)


def _parse(config_file, *overrides):
    """What `experiments/train.py --config=FILE --config.loss.cap=...` does (absl discovers the
    override flags from argv; sys_argv stands in for the process's argv)."""
    argv = ["train.py", f"--config={config_file}", *overrides]
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True,
                                    sys_argv=argv)
    flag_values(argv)
    return flag_values.config


def test_command_line_overrides_reach_the_loss(config_file):
    cfg = _parse(config_file, "--config.loss.name=tis", "--config.loss.cap=2.5",
                 "--config.loss.level=sequence", "--config.loss.agg=constant",
                 "--config.loss.max_tokens=512", "--config.advantage.estimator=rloo",
                 "--config.advantage.overlong=penalty", "--config.advantage.overlong_buffer=64")
    assert isinstance(cfg.loss.cap, float) and isinstance(cfg.loss.max_tokens, int)
    hp = loss_from_config(cfg.loss).hparams
    assert (hp["cap"], hp["level"], hp["agg"], hp["max_tokens"]) == (2.5, "sequence", "constant",
                                                                     512)
    assert cfg.advantage.estimator == "rloo" and cfg.advantage.overlong_buffer == 64

    cfg = _parse(config_file, "--config.loss.name=staleness_clip", "--config.loss.lag_cutoff=4",
                 "--config.loss.schedule=exp", "--config.loss.alpha=0.7")
    hp = loss_from_config(cfg.loss).hparams
    assert (hp["lag_cutoff"], hp["schedule"], hp["alpha"], hp["eps_low"]) == (4, "exp", 0.7,
                                                                              0.2)


def test_command_line_mistakes_fail(config_file):
    cfg = _parse(config_file, "--config.loss.name=ppo", "--config.loss.cap=2.0")
    with pytest.raises(ConfigError, match="^loss.cap"):
        loss_from_config(cfg.loss)
    with pytest.raises(AttributeError, match='Did you mean "cap"'):  # locked: typos fail
        _parse(config_file, "--config.loss.capp=2.0")
    with pytest.raises(flags.IllegalFlagValueError):  # placeholders keep their type
        _parse(config_file, "--config.loss.cap=two")


def test_advantage_config_defaults():
    cfg = advantage_config()
    assert (cfg.estimator, cfg.drop_zero_variance, cfg.overlong) == ("grpo", False, "none")

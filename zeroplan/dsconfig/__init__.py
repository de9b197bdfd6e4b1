"""DeepSpeed JSON configs: build one from a Plan (``build_config``), read one back into a Plan
(``plan_from_config``), parse a file defensively (``load_config``), validate one with rules."""

from zeroplan.dsconfig.build import build_config, build_config_with_notes, resolve_buckets
from zeroplan.dsconfig.parse import ParsedConfig, load_config, parse_config_text
from zeroplan.dsconfig.plan import plan_from_config, precision_from_config, training_from_config
from zeroplan.dsconfig.rules import RULES, Finding, Rule
from zeroplan.dsconfig import peft_rules as _peft_rules  # noqa: F401,E402  (registers ZP8xx)
from zeroplan.dsconfig import host_rules as _host_rules  # noqa: F401,E402  (registers ZP9xx)
from zeroplan.dsconfig.validate import has_errors, validate_config

__all__ = [
    "Finding",
    "ParsedConfig",
    "RULES",
    "Rule",
    "build_config",
    "build_config_with_notes",
    "has_errors",
    "load_config",
    "parse_config_text",
    "plan_from_config",
    "precision_from_config",
    "resolve_buckets",
    "training_from_config",
    "validate_config",
]

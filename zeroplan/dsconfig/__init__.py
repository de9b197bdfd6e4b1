"""DeepSpeed JSON configs: build one from a Plan, parse one defensively, validate one with rules."""

from zeroplan.dsconfig.build import build_config, build_config_with_notes, resolve_buckets
from zeroplan.dsconfig.parse import ParsedConfig, load_config, parse_config_text
from zeroplan.dsconfig.rules import RULES, Finding, Rule
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
    "resolve_buckets",
    "validate_config",
]

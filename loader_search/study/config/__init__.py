"""The study's configuration: the config file (TOML) read and checked into a `StudyConfig`, its
``[space]`` table, the user's own command as a workload (``[workload] command``), and what a
study stores for the processes that join it (the fingerprint, the config document, the budget).

Callers outside this folder import from ``loader_search.study.config``. Names load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loader_search._faces import lazy

_EXPORTS = {
    # the config file
    "StudyConfig": "loader_search.study.config._config",
    "SamplerConfig": "loader_search.study.config._config",
    "load_config": "loader_search.study.config._config",
    "parse_config": "loader_search.study.config._config",
    "command_config": "loader_search.study.config._config",
    "CONFIRM_PROCESSES": "loader_search.study.config._config",
    "SAMPLERS": "loader_search.study.config._config",
    # a command as the workload
    "CommandConfig": "loader_search.study.config._command_config",
    "check_command_allowed": "loader_search.study.config._command_config",
    "trusted_command": "loader_search.study.config._command_config",
    "OwnCommand": "loader_search.study.config._command_config",
    "ALLOW_COMMANDS_ENV": "loader_search.study.config._command_config",
    "COMMAND_WORKLOAD": "loader_search.study.config._command_config",
    # what a study stores for those who join it
    "fingerprint": "loader_search.study.config._stored",
    "describe": "loader_search.study.config._stored",
    "settle_budget": "loader_search.study.config._stored",
    "store_settings": "loader_search.study.config._stored",
    "stored_config": "loader_search.study.config._stored",
    "trusted_config": "loader_search.study.config._stored",
}

__all__ = [
    "ALLOW_COMMANDS_ENV",
    "COMMAND_WORKLOAD",
    "CONFIRM_PROCESSES",
    "SAMPLERS",
    "CommandConfig",
    "OwnCommand",
    "SamplerConfig",
    "StudyConfig",
    "check_command_allowed",
    "command_config",
    "describe",
    "fingerprint",
    "load_config",
    "parse_config",
    "settle_budget",
    "store_settings",
    "stored_config",
    "trusted_command",
    "trusted_config",
]

if TYPE_CHECKING:
    from loader_search.study.config._command_config import (
        ALLOW_COMMANDS_ENV,
        COMMAND_WORKLOAD,
        CommandConfig,
        OwnCommand,
        check_command_allowed,
        trusted_command,
    )
    from loader_search.study.config._config import (
        CONFIRM_PROCESSES,
        SAMPLERS,
        SamplerConfig,
        StudyConfig,
        command_config,
        load_config,
        parse_config,
    )
    from loader_search.study.config._stored import (
        describe,
        fingerprint,
        settle_budget,
        store_settings,
        stored_config,
        trusted_config,
    )


__getattr__ = lazy(__name__, _EXPORTS)

"""The run configuration: one pydantic model (``RunConfig``), loaded from YAML with dotted overrides.

Its modules by concern: ``base`` (errors, the section model, the late-settings rule), ``inputs``, ``training`` and
``run`` (the section models), ``loading`` (YAML, overrides, one-line errors), ``migrations`` (configs of older
releases) and ``trust`` (the allow-list of import paths). Every name is importable from here."""

from rlstage.schemas.config.base import (  # noqa: F401
    _RUN_NAME,
    FLAT_LOSS,
    FLAT_LOSS_SETTINGS,
    HASHED_WHEN_SET,
    ConfigDeprecation,
    ConfigError,
    FlatNames,
    _default,
    _Section,
    absolute_root,
    drop_unset_late_settings,
    parse_is_threshold,
)
from rlstage.schemas.config.inputs import (  # noqa: F401
    CALCULATOR_PATHS,
    DEFAULT_JUDGE_PROMPT,
    EXAMPLE_AGENT_PATHS,
    FLAT_VLLM,
    AgentConfig,
    DataConfig,
    KitConfig,
    ModelConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
    RewardModelPathConfig,
    RewardServerConfig,
    RolloutConfig,
    SFTConfig,
    StoreConfig,
    ToolConfig,
    VLLMConfig,
    reward_function_path,
)
from rlstage.schemas.config.loading import (  # noqa: F401
    _set_dotted,
    _yaml_problem,
    build_config,
    config_to_yaml,
    dotted,
    format_validation_error,
    load_config,
    merge_dicts,
    nearest_setting,
    nested,
    parse_overrides,
)
from rlstage.schemas.config.migrations import (  # noqa: F401
    _MOVED_BACK,
    FLAT_NAMES,
    FLAT_PATHS,
    MOVED_MODULES,
    NAMED_ENTRY_PATHS,
    flat_form,
    flat_loss_form,
    hashed_paths,
    legacy_callables,
    plain_entry_names,
)
from rlstage.schemas.config.run import (  # noqa: F401
    DrillConfig,
    RayConfig,
    RunConfig,
    StageResources,
    TrackingConfig,
    TrainerConfig,
)
from rlstage.schemas.config.training import (  # noqa: F401
    FLAT_AGG_SETTINGS,
    FLAT_ESTIMATOR_SETTINGS,
    ActorConfig,
    AdvEstimatorConfig,
    AlgorithmConfig,
    CriticConfig,
    FilterGroupsConfig,
    KLControlConfig,
    NamedEntryConfig,
    OptimConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from rlstage.schemas.config.trust import (  # noqa: F401
    ALLOWED_CALLABLES_ENV,
    allowed_callables,
    allowed_callables_file,
    code_settings,
    stored_config_from,
)

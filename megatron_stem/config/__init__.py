"""Typed recipes: dataclasses filled from YAML in strict mode, each problem named by the
field and by the file or override that set it.

    strict.py        the loader: a dataclass from a mapping, types, ranges, unknown keys
    schema.py        the recipe's sections (`Recipe`, `ModelConfig`, ...) and their rules
    table_layout.py  the six choices of how tables train, and which combinations are legal
    recipe_files.py  reading a recipe: `inherit:`, overrides, where each value came from
    printing.py      the resolved recipe as `--print-config` shows it

Everything a caller needs is importable from here (`from megatron_stem.config import
Recipe, load_recipe`); the modules import each other downward in the order above.
"""

from megatron_stem.config.recipe_files import (
    DEFAULT,
    OVERRIDE,
    RecipeSource,
    apply_override,
    apply_overrides,
    load_recipe,
    origin_of,
    parse_override,
)
from megatron_stem.config.schema import (
    DataBlend,
    DataConfig,
    DataSource,
    GuardConfig,
    LmEvalConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ProfileConfig,
    Recipe,
    RopeScalingConfig,
    StemPlacement,
    TableOptimizerConfig,
    TableStorageConfig,
    TrainConfig,
    load_blend,
    upgrade_saved_recipe,
)
from megatron_stem.config.strict import Range, collect, from_dict, read_mapping, to_dict
from megatron_stem.config.table_layout import TableLayout

__all__ = [
    "DEFAULT", "OVERRIDE", "RecipeSource", "apply_override", "apply_overrides", "load_recipe",
    "origin_of", "parse_override", "DataBlend", "DataConfig", "DataSource", "GuardConfig",
    "LmEvalConfig", "MetricsConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig",
    "ProfileConfig", "Recipe", "RopeScalingConfig", "StemPlacement", "TableOptimizerConfig",
    "TableStorageConfig", "TrainConfig", "load_blend", "upgrade_saved_recipe", "Range",
    "collect", "from_dict", "read_mapping", "to_dict", "TableLayout",
]

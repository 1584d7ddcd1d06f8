"""The reward zoo: one interface for every reward. See :mod:`mmgrpo.rewards.base`."""

from .base import GROUPWISE, POINTWISE, FunctionReward, Reward, RewardBatch, trl_reward
from .checks import as_rgb_images, as_rgb_videos, completions_or_raise
from .clip_models import Aesthetic, ClipScore, HPSv2, HPSv21, PickScore, TextEmbeddingCache
from .image_rules import ColorFraction, JpegCompressibility, JpegIncompressibility, Sharpness
from .preprocess import ClipPreprocess
from .text_rules import AccuracyReward, FormatReward, LengthReward, TemporalIoU
from .video import Motion, TemporalConsistency, VideoFrames
from .winrate import WinRate, pairwise_win_rate
from .zoo import RewardZoo, build_reward

__all__ = ["GROUPWISE", "POINTWISE", "AccuracyReward", "Aesthetic", "ClipPreprocess", "ClipScore",
           "ColorFraction", "FormatReward", "FunctionReward", "HPSv2", "HPSv21", "JpegCompressibility",
           "JpegIncompressibility", "LengthReward", "Motion", "PickScore", "Reward", "RewardBatch", "RewardZoo",
           "Sharpness", "TemporalConsistency", "TemporalIoU", "TextEmbeddingCache", "VideoFrames", "WinRate",
           "as_rgb_images", "as_rgb_videos", "build_reward", "completions_or_raise", "pairwise_win_rate",
           "trl_reward"]
from . import consistency_bonus as consistency_bonus
from . import remote as remote
from . import shapes_eval as shapes_eval
from . import temporal_bonus as temporal_bonus
from . import vlm_judge as vlm_judge

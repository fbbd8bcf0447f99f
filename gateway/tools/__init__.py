"""The command line's tools beside serving: the doctor, the capacity planner, and what they read of models and
GPUs."""

__all__ = [
    "doctor",  # vllm-guard doctor
    "planner",  # vllm-guard plan
]

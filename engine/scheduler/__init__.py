from engine.scheduler.scheduler import Scheduler, SchedulerStats

__all__ = ["Scheduler", "SchedulerStats"]

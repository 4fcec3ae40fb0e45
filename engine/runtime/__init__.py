"""The multi-process runtime, used by every process: starting the children, IPC sockets, and
the small typed messages that cross process boundaries."""

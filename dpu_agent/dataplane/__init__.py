"""The agent side of the data plane: sessions, their regions and queues, and job execution."""

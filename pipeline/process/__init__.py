"""Process lifecycle: no process tokentrail starts outlives the process that started it."""

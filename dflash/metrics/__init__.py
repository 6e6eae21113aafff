"""What the stages report: the metric names, the typed metrics files, the headline and DVCLive."""

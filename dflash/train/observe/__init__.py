"""What a run shows of itself: monitors, step clocks, stability, composition, pilots."""

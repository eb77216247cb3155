"""What the stages' metrics say about their transfers and streams: the pages read (from the
pods or from Prometheus) and the verdict on them (stuck, failing, stalled). The controller's
status and the local run's table both read it."""

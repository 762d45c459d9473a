"""Real servers for tests that need one (SeaweedFS for S3, ...), started by pytest fixtures."""

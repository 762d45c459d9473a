"""Our C helpers, compiled on first use with the system C compiler (`build.compiled`)."""

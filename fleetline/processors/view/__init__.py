"""The global resource view: its fold (pure), folder, snapshots and stream runtime."""

# The view's consumer group and the name its snapshots are kept under; here rather than in
# the runtime so that the CLI names it without importing the stream and storage stack.
APPLICATION_ID = "resource-view"

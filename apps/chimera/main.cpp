// Placeholder until the CLI lands (this commit only sets up the build).
int main() { return 0; }
